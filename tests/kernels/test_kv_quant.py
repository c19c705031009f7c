"""Quantized KV caches (pagedkv.kernels.kv_quant): the formats' round trip within their error
bound, static scales, argument checks, configuration, capacity accounting, checkpoint scales."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from pagedkv import EngineArgs, kernels
from pagedkv.config import KV_SCALE_BYTES, CacheConfig, KVGeometry
from pagedkv.errors import ConfigError, InvalidArgumentError, ModelLoadError
from pagedkv.kernels import KVScales, kv_quant, reference, validation
from pagedkv.kernels.kv_quant import FORMATS, SCALE_DTYPE, check_static_scale, quantize_kv
from pagedkv.sim.kv_budget import kv_geometry

FORMAT_NAMES = sorted(FORMATS)
NUM_BLOCKS, BLOCK_SIZE, HKV, D = 6, 16, 3, 64


def _hard_vectors(fmt: kv_quant.KVFormat, generator: torch.Generator) -> torch.Tensor:  # [N, HKV, D] float32
    """Random vectors plus the cases a quantizer gets wrong: zeros, one outlier, values at the
    format's range limits, tiny values, huge and tiny magnitudes."""
    x = torch.randn(40, HKV, D, generator=generator)
    x[0] = 0.0  # all-zero vectors
    x[1, 0, 7] = 1000.0  # one outlier in an otherwise N(0, 1) vector
    x[2] = torch.linspace(-fmt.qmax, fmt.qmax, D)  # exactly the format's range at scale 1
    x[3] = 1e-30 * torch.randn(HKV, D, generator=generator)  # tiny
    x[4] = 1e30 * torch.randn(HKV, D, generator=generator)  # huge (bf16 scale keeps float32 range)
    x[5, :, ::2] = 0.0  # half zeros
    x[6] = 2.0**-20 * torch.randn(HKV, D, generator=generator)
    return x


def _scales(num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE) -> KVScales:
    shape = (num_blocks, block_size, HKV)
    return KVScales(torch.zeros(shape, dtype=SCALE_DTYPE), torch.zeros(shape, dtype=SCALE_DTYPE))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_quantize_round_trip_within_half_a_grid_step(name: str) -> None:
    fmt = FORMATS[name]
    x = _hard_vectors(fmt, torch.Generator().manual_seed(1))
    data, scales = quantize_kv(x, fmt)
    assert data.dtype == fmt.storage_dtype and scales.dtype == SCALE_DTYPE
    assert bool((scales.float() > 0).all())
    back = kv_quant.dequantize(data, scales, torch.float64)
    assert bool(torch.isfinite(back).all())
    err = (back - x.double()).abs()
    bound = fmt.error_bound(x.abs(), scales.float()[..., None])
    assert bool((err <= bound).all()), f"worst error / bound = {float((err / bound.clamp_min(1e-300)).max())}"
    # The scale is absmax / qmax rounded up to bfloat16: never saturates, loses < 1/128 of range.
    absmax = x.abs().amax(-1)
    nonzero = absmax > 0
    used = absmax[nonzero] / (scales.float()[nonzero] * fmt.qmax)
    assert bool((used <= 1.0).all()) and bool((used > 1 - 2**-7).all())
    assert bool((data[0].float() == 0).all())  # zero vectors store zeros


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_store_kv_writes_data_and_scales_at_the_slot(name: str) -> None:
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(2)
    key, value = _hard_vectors(fmt, g), torch.randn(40, HKV, D, generator=g)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:40]
    slots[5] = -1  # skipped token
    kc = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D, dtype=fmt.storage_dtype)
    vc = torch.zeros_like(kc)
    scales = _scales()
    kernels.store_kv(key, value, kc, vc, slots, kv_scales=scales, backend="torch")
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, BLOCK_SIZE)
        if slot < 0:
            continue
        for source, cache, sc in ((key, kc, scales.key), (value, vc, scales.value)):
            back = kv_quant.dequantize(cache[b, o], sc[b, o], torch.float64)
            bound = fmt.error_bound(source[t].abs(), sc[b, o].float()[:, None])
            assert bool(((back - source[t].double()).abs() <= bound).all())
    # The skipped token's slot stays empty unless another token owns it.
    assert int((scales.key.float() > 0).sum()) == 39 * HKV


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_quantized_attention_equals_attention_over_the_dequantized_cache(name: str) -> None:
    """The oracle's quantized path == float64 attention over the dequantized cache."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(3)
    lens = [37, 1, 16]
    tables = torch.tensor([[4, 0, 2], [5, -1, -1], [1, -1, -1]], dtype=torch.int32)
    kc = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D, dtype=fmt.storage_dtype)
    vc = torch.zeros_like(kc)
    scales = _scales()
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
        reference.store_kv(k, v, kc, vc, slots, kv_scales=scales)
    q_lens = [5, 1, 16]
    cu = torch.tensor([0, 5, 6, 22], dtype=torch.int32)
    query = torch.randn(22, 2 * HKV, D, generator=g, dtype=torch.float64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = reference.paged_attention(query, kc, vc, tables, seq_lens, cu, kv_scales=scales)
    kd = kv_quant.dequantize(kc, scales.key, torch.float64)
    vd = kv_quant.dequantize(vc, scales.value, torch.float64)
    want = reference.paged_attention(query, kd, vd, tables, seq_lens, cu)
    assert sum(q_lens) == 22
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_key_rotation_is_a_fixed_orthogonal_matrix(head_dim: int) -> None:
    r = kv_quant.key_rotation(head_dim, torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(r, kv_quant.key_rotation(head_dim, torch.float64))  # same in every process


def test_key_rotation_leaves_attention_unchanged_and_cuts_the_error_of_outlier_channels() -> None:
    """Rotated keys + rotated queries == the same attention (exactly, over the dequantized
    cache); with an outlier channel in K the quantized result is much closer to float64."""
    g = torch.Generator().manual_seed(5)
    n, heads = 48, 2 * HKV
    key, value = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    key[:, :, 3] *= 40.0  # post-RoPE keys have a few huge channels
    query = torch.randn(1, heads, D, generator=g, dtype=torch.float64)
    tables = torch.tensor([[2, 0, 5]], dtype=torch.int32)
    pos = torch.arange(n)
    slots = tables[0, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    seq_lens, cu = torch.tensor([n], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    exact_k = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D, dtype=torch.float64)
    exact_v = torch.zeros_like(exact_k)
    reference.store_kv(key.double(), value.double(), exact_k, exact_v, slots)
    want = reference.paged_attention(query, exact_k, exact_v, tables, seq_lens, cu)
    errors = {}
    for rotated in (False, True):
        rotation = kv_quant.key_rotation(D) if rotated else None
        scales = KVScales(_scales().key, _scales().value, key_rotation=rotation)
        kc = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D, dtype=torch.int8)
        vc = torch.zeros_like(kc)
        kernels.store_kv(key, value, kc, vc, slots, kv_scales=scales, backend="torch")
        got = kernels.paged_attention(query, kc, vc, tables, seq_lens, cu, kv_scales=scales, backend="torch")
        # The same computation spelled out: float64 attention of the rotated query over the
        # dequantized (rotated) keys.
        kd = kv_quant.dequantize(kc, scales.key, torch.float64)
        vd = kv_quant.dequantize(vc, scales.value, torch.float64)
        q = query if rotation is None else query @ rotation.double()
        torch.testing.assert_close(got, reference.paged_attention(q, kd, vd, tables, seq_lens, cu), rtol=0, atol=1e-12)
        errors[rotated] = float((got - want).abs().max())
    assert errors[True] < 0.5 * errors[False], errors


def test_bad_key_rotation_is_a_typed_error() -> None:
    kc = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D, dtype=torch.int8)
    bad = KVScales(_scales().key, _scales().value, key_rotation=torch.eye(D + 1))
    with pytest.raises(InvalidArgumentError, match="key_rotation"):
        kernels.store_kv(
            torch.randn(1, HKV, D), torch.randn(1, HKV, D), kc, kc.clone(), torch.tensor([0]), kv_scales=bad
        )


def test_static_scales_saturate_and_are_stored() -> None:
    fmt = FORMATS["int8"]
    static = check_static_scale("k_scale", 0.01, HKV)
    x = torch.full((2, HKV, D), 0.5)
    x[1] = 100.0  # far beyond 127 * 0.01: saturates
    data, scales = quantize_kv(x, fmt, static)
    assert bool((scales.float() == static.float()).all())
    assert bool((data[1] == 127).all())
    assert bool((data[0] == 50).all())


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0.0, "finite and positive"),
        (-1.0, "finite and positive"),
        (float("nan"), "finite and positive"),
        (float("inf"), "finite and positive"),
        (torch.ones(HKV + 1), "one scale per tensor or one per KV head"),
        (torch.ones(1, HKV), "one scale per tensor or one per KV head"),
        (torch.ones(HKV, dtype=torch.int32), "floating-point"),
    ],
)
def test_bad_static_scales_are_typed_errors(value: object, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        check_static_scale("k_scale", value, HKV)


def test_static_scale_shapes_accepted() -> None:
    assert check_static_scale("s", 0.5, HKV).tolist() == [0.5] * HKV
    assert check_static_scale("s", torch.tensor([0.5]), HKV).shape == (HKV,)
    per_head = check_static_scale("s", torch.tensor([0.25, 0.5, 1.0]), HKV)
    assert per_head.tolist() == [0.25, 0.5, 1.0]


def test_quantized_cache_needs_matching_scales() -> None:
    kc = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D, dtype=torch.int8)
    key = torch.randn(2, HKV, D)
    slots = torch.tensor([0, 1])
    with pytest.raises(InvalidArgumentError, match="needs its scales"):
        kernels.store_kv(key, key, kc, kc.clone(), slots, backend="torch")
    bad_dtype = KVScales(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV))
    with pytest.raises(InvalidArgumentError, match="kv_scales.key must be"):
        kernels.store_kv(key, key, kc, kc.clone(), slots, kv_scales=bad_dtype, backend="torch")
    bad_shape = _scales(num_blocks=NUM_BLOCKS + 1)
    with pytest.raises(InvalidArgumentError, match="kv_scales.key must be"):
        kernels.store_kv(key, key, kc, kc.clone(), slots, kv_scales=bad_shape, backend="torch")
    bad_static = KVScales(_scales().key, _scales().value, static_key=torch.ones(HKV + 1))
    with pytest.raises(InvalidArgumentError, match="static_key"):
        kernels.store_kv(key, key, kc, kc.clone(), slots, kv_scales=bad_static, backend="torch")
    float_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    with pytest.raises(InvalidArgumentError, match="not quantized"):
        kernels.store_kv(key, key, float_cache, float_cache.clone(), slots, kv_scales=_scales(), backend="torch")
    query = torch.randn(1, HKV, D)
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="needs its scales"):
        kernels.paged_attention(
            query, kc, kc.clone(), one[None] * 0, one, torch.tensor([0, 1], dtype=torch.int32), backend="torch"
        )


def test_e4m3_needs_compute_capability_89_on_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")
    with pytest.raises(InvalidArgumentError, match="8.9"):
        validation.check_backend_supports("triton", torch.float16, 64, torch.float8_e4m3fn, cuda)
    validation.check_backend_supports("triton", torch.float16, 64, torch.float8_e5m2, cuda)
    validation.check_backend_supports("triton", torch.float16, 64, torch.int8, cuda)


# ---------------------------------------------------------------- configuration and capacity


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("auto", "auto"),
        ("int8", "int8"),
        ("fp8", "fp8_e4m3"),
        ("fp8_e5m2", "fp8_e5m2"),
        (torch.float8_e5m2, "fp8_e5m2"),
    ],
)
def test_kv_cache_dtype_values(given: object, canonical: str) -> None:
    assert CacheConfig(kv_cache_dtype=given).kv_cache_dtype == canonical  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["int4", "fp8_e4m3fnuz", "", None, torch.float16])
def test_unknown_kv_cache_dtype_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype=bad)  # type: ignore[arg-type]


def test_checkpoint_scales_need_a_quantized_cache() -> None:
    with pytest.raises(ConfigError, match="needs a quantized kv_cache_dtype"):
        EngineArgs(kv_cache_scales="checkpoint")
    with pytest.raises(ConfigError, match="kv_cache_scales must be one of"):
        EngineArgs(kv_cache_dtype="int8", kv_cache_scales="static")


def test_bytes_per_token_include_the_scales() -> None:
    f32 = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", dtype_bytes=4)
    i8 = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype="int8", dtype_bytes=1, scale_bytes=2)
    assert i8.bytes_per_token == 2 * 30 * 3 * (64 + KV_SCALE_BYTES)
    assert f32.bytes_per_token / i8.bytes_per_token >= 3.8
    assert "2 B scale" in i8.describe()


def test_simulate_geometry_per_kv_dtype() -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    assert kv_geometry(config, kv_dtype="bfloat16").bytes_per_token == 2 * 2 * 2 * 64 * 2
    for name, canonical in (("int8", "int8"), ("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")):
        geometry = kv_geometry(config, kv_dtype=name)
        assert geometry.dtype == canonical and geometry.bytes_per_token == 2 * 2 * 2 * (64 + 2)
    with pytest.raises(ConfigError, match="not known"):
        kv_geometry(config, kv_dtype="int4")


# ---------------------------------------------------------------- checkpoint scales


def _checkpoint(tmp_path: pathlib.Path, tensors: dict[str, torch.Tensor]) -> str:
    """The embedded model's folder (symlinked) with an extra safetensors file of KV scales."""
    from safetensors.torch import save_file

    from pagedkv.worker.model_files import default_model_dir

    folder = tmp_path / "model"
    folder.mkdir()
    for entry in pathlib.Path(default_model_dir()).iterdir():
        (folder / entry.name).symlink_to(entry)
    save_file(tensors, str(folder / "kv_scales.safetensors"))
    return str(folder)


def _scale_tensors(num_layers: int, k: float = 0.05, v: float = 0.02) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(num_layers):
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v, v, v])
    return out


def test_checkpoint_scales_are_loaded(tmp_path: pathlib.Path) -> None:
    from pagedkv.worker.checkpoint_scales import load_checkpoint_kv_scales

    folder = _checkpoint(tmp_path, _scale_tensors(30))
    k, v = load_checkpoint_kv_scales(folder, 30, 3)
    assert len(k) == len(v) == 30
    assert math.isclose(float(k[0][0]), 0.05, rel_tol=2**-7) and float(k[0][0]) >= 0.05
    assert v[29].shape == (3,)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({}, "no k_scale / v_scale"),
        ({**_scale_tensors(30), "model.layers.30.self_attn.k_scale": torch.tensor(0.1)}, "layer 30"),
        ({k: t for k, t in _scale_tensors(30).items() if "layers.7." not in k}, "layer 7"),
        ({**_scale_tensors(30), "model.layers.3.self_attn.v_scale": torch.tensor(0.0)}, "finite and positive"),
        ({**_scale_tensors(30), "model.layers.3.self_attn.k_scale": torch.ones(2)}, "one per KV head"),
    ],
)
def test_bad_checkpoint_scales_are_load_errors(
    tmp_path: pathlib.Path, tensors: dict[str, torch.Tensor], match: str
) -> None:
    from pagedkv.worker.checkpoint_scales import load_checkpoint_kv_scales

    folder = _checkpoint(tmp_path, tensors or {"unrelated": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match=match):
        load_checkpoint_kv_scales(folder, 30, 3)
