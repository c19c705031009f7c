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
    # fp8: 1 byte per value plus a 2-byte scale per (token, KV head) vector.
    assert kv_geometry(SMOLLM2, kv_dtype="fp8").bytes_per_token == 2 * 30 * 3 * (64 + 2) == 11_880
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
    nested = {
        "torch_dtype": "bfloat16",
        "text_config": {"num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
    }
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
    g = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", dtype_bytes=4, num_heads=9)
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
    [
        ("4096", 4096),
        ("1GiB", 2**30),
        ("1.5 GiB", 3 * 2**29),
        ("512MB", 512 * 10**6),
        ("2e9", 2 * 10**9),
        ("8kib", 8192),
        ("3g", 3 * 10**9),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "1 parsec", "0", "0.5"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="kv_memory"):
        parse_bytes(text)


# ---------------------------------------------------------------- pagedkv.config: the validated configs


def test_one_geometry_type_for_the_simulator_and_the_runner() -> None:
    import pagedkv.config
    import pagedkv.sim.kv_budget
    import pagedkv.worker.model_support as model_support

    assert pagedkv.sim.kv_budget.KVGeometry is pagedkv.config.KVGeometry
    assert not hasattr(model_support, "AttentionGeometry")
    g = kv_geometry(SMOLLM2)
    assert (g.num_heads, g.bytes_per_token) == (9, 46_080)
    assert (
        kv_geometry({"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8, "dtype": "float16"}).num_heads
        is None
    )


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda c: c.CacheConfig(block_size=12), "block_size must be a power of two in 8 .. 4096, got 12"),
        (lambda c: c.CacheConfig(block_size=4), "block_size .* got 4"),
        (lambda c: c.CacheConfig(block_size=16.0), r"block_size .* got 16\.0"),
        (lambda c: c.CacheConfig(num_blocks=0), "num_blocks must be a positive int, got 0"),
        (lambda c: c.CacheConfig(num_blocks=2**24 + 1), "num_blocks must be at most 16777216"),
        (lambda c: c.CacheConfig(kv_cache_memory=-5), "kv_cache_memory must be a positive number of bytes, got -5"),
        (lambda c: c.CacheConfig(num_blocks=8, kv_cache_memory=1 << 20), "num_blocks or kv_cache_memory, not both"),
        (
            lambda c: c.CacheConfig(gpu_memory_utilization=0.0),
            r"gpu_memory_utilization must be a number in \(0, 1\], got 0.0",
        ),
        (lambda c: c.CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization .* got 1.5"),
        (lambda c: c.CacheConfig(gpu_memory_utilization=True), "gpu_memory_utilization .* got True"),
        (lambda c: c.CacheConfig(enable_prefix_caching=1), "enable_prefix_caching must be a bool, got 1"),
        (lambda c: c.ModelConfig(dtype="int8"), "dtype must be one of .* got 'int8'"),
        (lambda c: c.ModelConfig(device="tpu"), "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        (lambda c: c.ModelConfig(max_model_len=0), "max_model_len must be a positive int, got 0"),
        (lambda c: c.ModelConfig(max_model_len=True), "max_model_len must be a positive int, got True"),
        (lambda c: c.ModelConfig(attention_backend="flash"), "attention_backend must be .* got 'flash'"),
        (lambda c: c.ModelConfig(attention_backend="cpu", device="cuda"), "attention_backend 'cpu' runs on the CPU"),
        (lambda c: c.ModelConfig(seed="1"), "seed must be an int, got '1'"),
        (lambda c: c.ModelConfig(model=3), "model must be a model id or folder"),
        (lambda c: c.SchedulingConfig(max_num_seqs=0), "max_num_seqs must be a positive int, got 0"),
        (
            lambda c: c.SchedulingConfig(max_num_batched_tokens=None),
            "max_num_batched_tokens must be a positive int, got None",
        ),
        (lambda c: c.SchedulingConfig(policy="lifo"), "scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"),
        (
            lambda c: c.EngineConfig(c.ModelConfig(max_model_len=512), c.CacheConfig(num_blocks=8)),
            r"holds 128 tokens \(8 blocks of 16\), fewer than one request of max_model_len = 512",
        ),
    ],
)
def test_bad_config_values_name_the_field_and_value(make, fragment: str) -> None:
    import pagedkv.config

    with pytest.raises(ConfigError, match=fragment):
        make(pagedkv.config)


def test_configs_normalise_torch_names_and_paths(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from pagedkv.config import ModelConfig

    config = ModelConfig(model=tmp_path, dtype=torch.bfloat16, device=torch.device("cuda", 1))
    assert (config.model, config.dtype, config.device) == (str(tmp_path), "bfloat16", "cuda:1")


def test_engine_args_validate_everything_when_built() -> None:
    from pagedkv.config import EngineConfig
    from pagedkv.engine.args import EngineArgs

    config = EngineArgs(
        block_size=32, num_blocks=64, max_model_len=1024, scheduling_policy="priority", max_num_seqs=8
    ).create_engine_config()
    assert isinstance(config, EngineConfig)
    assert (config.cache.block_size, config.cache.num_blocks, config.model.max_model_len) == (32, 64, 1024)
    assert (config.scheduling.policy, config.scheduling.max_num_seqs) == ("priority", 8)
    for kwargs, fragment in [
        ({"block_size": 5000}, "block_size"),
        ({"num_blocks": 10**12}, "num_blocks must be at most"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"gpu_memory_utilization": 2}, "gpu_memory_utilization"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_model_len": 512, "num_blocks": 8}, "fewer than one request"),
        ({"dtype": "float64"}, "dtype"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            EngineArgs(**kwargs)
