"""KV bytes per token from model configs, budgets in bytes, and their errors."""

from __future__ import annotations

import json

import pytest

from pagedkv.errors import ConfigError
from pagedkv.sim.kv_budget import (
    KVGeometry,
    kv_geometry,
    load_kv_geometry,
    load_model_config,
    num_blocks_for_budget,
    parse_bytes,
)

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "dtype": "float32",
    "head_dim": 64,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
}


def test_smollm2_bytes_per_token_is_2_x_layers_x_kv_heads_x_head_dim_x_dtype() -> None:
    g = kv_geometry(SMOLLM2)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, g.dtype_bytes) == (30, 3, 64, "float32", 4)
    assert g.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert g.bytes_per_block(16) == 16 * 46_080
    assert kv_geometry(SMOLLM2, kv_dtype="bfloat16").bytes_per_token == 23_040
    assert kv_geometry(SMOLLM2, kv_dtype="fp8").bytes_per_token == 11_520
    assert kv_geometry(SMOLLM2, kv_dtype="torch.float16").dtype == "float16"


def test_llama2_13b_style_config_without_head_dim_or_kv_heads() -> None:
    # Multi-head attention: KV heads default to attention heads, head_dim = hidden / heads.
    config = {"num_hidden_layers": 40, "num_attention_heads": 40, "hidden_size": 5120, "torch_dtype": "float16"}
    g = kv_geometry(config)
    assert (g.num_kv_heads, g.head_dim, g.dtype_bytes) == (40, 128, 2)
    assert g.bytes_per_token == 2 * 40 * 40 * 128 * 2 == 819_200  # the paper's 800 KB per token


def test_aliases_multi_query_and_text_config() -> None:
    gpt2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "torch_dtype": "float32"}
    assert kv_geometry(gpt2).bytes_per_token == 2 * 12 * 12 * 64 * 4
    falcon = {"num_hidden_layers": 32, "num_attention_heads": 71, "hidden_size": 4544, "multi_query": True}
    assert kv_geometry(falcon, kv_dtype="bfloat16").num_kv_heads == 1
    nested = {"torch_dtype": "bfloat16", "text_config": {"num_hidden_layers": 26, "num_attention_heads": 8,
                                                          "num_key_value_heads": 4, "head_dim": 256}}
    g = kv_geometry(nested)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) == (26, 4, 256, "bfloat16")
    # A null head_dim (some configs write it) falls back to hidden_size / heads.
    assert kv_geometry({**SMOLLM2, "head_dim": None}).head_dim == 576 // 9


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"num_hidden_layers": "30"}, "num_hidden_layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_key_value_heads": -3}, "num_key_value_heads"),
        ({"num_key_value_heads": True}, "num_key_value_heads"),
        ({"head_dim": None, "hidden_size": None}, "hidden_size"),
        ({"head_dim": None, "hidden_size": 577}, "head_dim"),
        ({"dtype": None}, "torch_dtype"),
        ({"dtype": "int4"}, "dtype"),
        ({"kv_lora_rank": 512}, "kv_lora_rank"),
    ],
)
def test_missing_or_bad_fields_are_config_errors_naming_the_field(change: dict, field: str) -> None:
    config = {k: v for k, v in {**SMOLLM2, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=f"'{field}'"):
        kv_geometry(config, source="cfg.json")


def test_missing_heads_entirely() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        kv_geometry({"num_hidden_layers": 2, "head_dim": 64, "dtype": "float16"})


def test_unknown_kv_dtype() -> None:
    with pytest.raises(ConfigError, match="'int3'"):
        kv_geometry(SMOLLM2, kv_dtype="int3")


def test_load_from_folder_or_file_and_file_errors(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert load_kv_geometry(tmp_path).bytes_per_token == 46_080
    assert load_kv_geometry(tmp_path / "config.json", kv_dtype="float16").bytes_per_token == 23_040
    _, source = load_model_config(tmp_path)
    assert source.endswith("config.json")
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_config(tmp_path / "missing")
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_hidden_layers": 30,\n oops}')
    with pytest.raises(ConfigError, match="not valid JSON.*line 2"):
        load_model_config(bad)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_model_config(listed)


def test_default_model_is_smollm2() -> None:
    g = load_kv_geometry(None, kv_dtype="bfloat16")
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (30, 3, 64)


def test_blocks_for_budget() -> None:
    g = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", dtype_bytes=4)
    per_block = 46_080 * 16
    assert num_blocks_for_budget(per_block, g, 16) == 1
    assert num_blocks_for_budget(10 * per_block + per_block - 1, g, 16) == 10
    assert num_blocks_for_budget(2**30, g, 16) == 2**30 // per_block == 1456
    with pytest.raises(ConfigError, match="kv_memory.*smaller than one block"):
        num_blocks_for_budget(per_block - 1, g, 16)
    with pytest.raises(ConfigError, match="kv_memory"):
        num_blocks_for_budget(0, g, 16)
    with pytest.raises(ConfigError, match="block_size"):
        num_blocks_for_budget(per_block, g, 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("1GiB", 2**30), ("1.5 GiB", 3 * 2**29), ("512MB", 512 * 10**6), ("2e9", 2 * 10**9),
     ("8kib", 8192), ("3g", 3 * 10**9)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "1 parsec", "0", "0.5"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="kv_memory"):
        parse_bytes(text)
