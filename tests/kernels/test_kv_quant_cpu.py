"""The CPU decode kernel over quantized KV caches (int8, fp8 e4m3, fp8 e5m2) against
the float64 oracle, and its bad inputs.

The kernel (rust/cpu_attention.rs) and the oracle (``reference.paged_attention`` on a float64
query) read the same codes and scales, so they differ only by the kernel's float32 arithmetic.
The tolerance is derived from that (:func:`error_bound`), per output value, with ``u = 2^-24``:

* a score is ``scale * k_scale * (q . k_codes)`` summed in 8 float32 lanes (``D / 8`` terms
  each, a 3-level reduction, the factor): its error is at most ``(D / 8 + 4) u S`` with
  ``S = scale * sum_d |q_d| |k_d|``, the row's largest such sum over the keys it sees;
* the softmax weight of a key is ``exp(s - max)`` (relative error < 4u) over a sum of them:
  a score error ``e`` moves it by a factor ``exp(+-2e)``, so weights are off by at most
  ``4 (D / 8 + 4) u (1 + S)`` relative (plus a few ``u``);
* the output accumulates ``w * v_scale * v_codes`` over the ``seq_len`` keys in order: at most
  ``seq_len`` roundings, each relative to ``sum_p w_p |v_p|`` (the oracle over ``|V|``,
  ``mag``), which also bounds the effect of the weight errors.

So ``|got - want| <= u * mag * (4 (D / 8 + 4) (1 + S) + 2 seq_len + 16)`` (+1e-40 for values
that are subnormal in float32). The observed errors are well inside it (see
``test_error_bound_is_tight``).

Every cache slot no sequence owns holds NaN (fp8: the NaN code; int8: code 127 with a NaN
scale), so reading one shows up as a NaN output; the oracle reads a copy with those slots
zeroed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from paged_batches import make_paged_batch

import pagedkv.kernels as kernels
from pagedkv._core import paged_decode_attention_cpu
from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import cpu, kv_quant, reference
from pagedkv.kernels.kv_quant import KVFormat, KVScales

FORMATS = list(kv_quant.FORMATS)
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 3 and 4; D = 80 exercises the tails.
GEOMETRIES = [(4, 4, 64), (9, 3, 64), (8, 2, 80)]
BLOCK_SIZES = [16, 32]
U = 2.0**-24


def batch_shape(kind: str, block_size: int) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens): decodes of lengths around block boundaries, or a mixed batch with
    extends (prefix ending mid-block) and a whole prefill (q_len == seq_len)."""
    bs = block_size
    if kind == "decode":
        return [1] * 6, [1, bs - 1, bs, bs + 1, 2 * bs + 7, 3 * bs]
    return [1, 5, 1, 12, 1], [bs + 3, 2 * bs + 1, 1, 12, 3 * bs - 2]


def special_vectors(keys: list[torch.Tensor], values: list[torch.Tensor], fmt: KVFormat) -> None:
    """Edits the random K/V of each sequence (in place): zero vectors, a vector with one large
    outlier (the rest of it lands on the format's smallest codes, subnormal ones for fp8), tiny
    vectors (scales near bfloat16's smallest normal), V vectors at the format's largest codes
    with scale 1 and huge V vectors. (No huge K: the scores of a huge key are beyond float32's
    resolution in any kernel.)"""
    for k, v in zip(keys, values):
        n, hkv = k.shape[0], k.shape[1]
        k[0, 0] = 0.0
        v[0, hkv - 1] = 0.0
        if n > 1:
            k[1, hkv - 1, 3] = 40.0
            v[1, 0, 5] = 1.0e4
        if n > 2:
            k[2] *= 1e-30
            v[2, 0] *= 1e-35
        if n > 3:
            signs = torch.where(v[3] >= 0, 1.0, -1.0)
            v[3] = signs * fmt.qmax * torch.linspace(0.5, 1.0, v.shape[2])  # codes up to +-qmax, scale 1
        if n > 4:
            v[4, hkv - 1] *= 1e30
        if n > 5:
            k[n // 2, 0] = 0.0


@dataclass
class QuantBatch:
    query: torch.Tensor  # [T, H, D] float32
    key_cache: torch.Tensor  # quantized, unowned slots poisoned
    value_cache: torch.Tensor
    kv_scales: KVScales
    clean_key_cache: torch.Tensor  # unowned slots zeroed (for the oracle)
    clean_value_cache: torch.Tensor
    clean_scales: KVScales
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    fmt: KVFormat

    def index_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.block_tables, self.seq_lens, self.cu_seqlens_q


def make_quant_batch(
    fmt_name: str,
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
) -> QuantBatch:
    """A paged batch (shuffled block tables, from :func:`make_paged_batch`) whose caches hold
    ``quantize_kv`` of the sequences' K/V with :func:`special_vectors` mixed in."""
    fmt = kv_quant.FORMATS[fmt_name]
    batch = make_paged_batch(
        q_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=seed,
        poison=False,
    )
    special_vectors(batch.keys, batch.values, fmt)
    num_blocks = batch.key_cache.shape[0]
    slots = torch.cat(
        [
            batch.block_tables[b, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
            for b, n in enumerate(seq_lens)
        ]
    )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    poison_code = 127 if fmt.storage_dtype == torch.int8 else 0x7F  # fp8: the NaN code
    raw_dtype = torch.int8 if fmt.storage_dtype == torch.int8 else torch.uint8
    caches, scales = [], []
    for x in (torch.cat(batch.keys), torch.cat(batch.values)):
        data, scale = kv_quant.quantize_kv(x, fmt)
        cache = torch.full(shape, poison_code, dtype=raw_dtype).view(fmt.storage_dtype)
        cache.view(-1, num_kv_heads, head_dim)[slots] = data
        cache_scales = torch.full(shape[:3], float("nan"), dtype=kv_quant.SCALE_DTYPE)
        cache_scales.view(-1, num_kv_heads)[slots] = scale
        caches.append(cache)
        scales.append(cache_scales)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    owned[slots] = True
    owned = owned.view(num_blocks, block_size)
    clean = [torch.where(owned[..., None, None], c.view(raw_dtype), 0).view(fmt.storage_dtype) for c in caches]
    clean_scales = [torch.where(owned[..., None], s, 1.0) for s in scales]
    return QuantBatch(
        query=batch.query,
        key_cache=caches[0],
        value_cache=caches[1],
        kv_scales=KVScales(scales[0], scales[1]),
        clean_key_cache=clean[0],
        clean_value_cache=clean[1],
        clean_scales=KVScales(clean_scales[0], clean_scales[1]),
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        cu_seqlens_q=batch.cu_seqlens_q,
        fmt=fmt,
    )


def magnitudes(qb: QuantBatch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle over ``|V|`` (``mag``, [T, H, D]) and each query row's largest
    ``scale * sum_d |q_d| |k_d|`` over the keys it sees (``S``, [T, H, 1]), in float64."""
    raw = torch.int8 if qb.fmt.storage_dtype == torch.int8 else torch.uint8
    codes = qb.clean_value_cache.view(raw)
    abs_codes = codes.abs() if raw == torch.int8 else codes & 0x7F  # fp8: clear the sign bit
    mag = reference.paged_attention(
        qb.query.double(),
        qb.clean_key_cache,
        abs_codes.view(qb.fmt.storage_dtype),
        *qb.index_args(),
        scale=scale,
        kv_scales=qb.clean_scales,
    )
    num_heads, block_size, num_kv_heads = qb.query.shape[1], qb.key_cache.shape[1], qb.key_cache.shape[2]
    keys = kv_quant.dequantize(qb.clean_key_cache, qb.clean_scales.key, torch.float64).abs()
    s_max = torch.zeros(qb.query.shape[0], num_heads, 1, dtype=torch.float64)
    cu, lens = qb.cu_seqlens_q.tolist(), qb.seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        positions = torch.arange(seq_len)
        blocks = qb.block_tables[b, positions // block_size].long()
        k = keys[blocks, positions % block_size]  # [L, Hkv, D]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        q = qb.query[cu[b] : cu[b + 1]].double().abs()  # [q_len, H, D]
        sums = scale * torch.einsum("ihd,phd->ihp", q, k)
        q_len = q.shape[0]
        visible = positions[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]  # [q_len, L]
        sums = sums.masked_fill(~visible[:, None, :], 0.0)
        s_max[cu[b] : cu[b + 1]] = sums.amax(dim=-1, keepdim=True)
    return mag, s_max


def error_bound(qb: QuantBatch, scale: float) -> torch.Tensor:
    """The largest float32 error of each output value (module docstring)."""
    mag, s_max = magnitudes(qb, scale)
    head_dim = qb.query.shape[2]
    seq_len = torch.zeros(qb.query.shape[0], 1, 1, dtype=torch.float64)
    cu = qb.cu_seqlens_q.tolist()
    for b, n in enumerate(qb.seq_lens.tolist()):
        seq_len[cu[b] : cu[b + 1]] = n
    return U * mag * (4 * (head_dim // 8 + 4) * (1 + s_max) + 2 * seq_len + 16) + 1e-40


def oracle(qb: QuantBatch, scale: float) -> torch.Tensor:
    return reference.paged_attention(
        qb.query.double(),
        qb.clean_key_cache,
        qb.clean_value_cache,
        *qb.index_args(),
        scale=scale,
        kv_scales=qb.clean_scales,
    )


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """Checks ``|got - want| <= bound`` everywhere; returns the largest error / bound."""
    assert got.dtype == torch.float32 and torch.isfinite(got).all(), "NaN/inf: a poisoned slot was read"
    err = (got.double() - want).abs()
    ratio = float((err / bound).max())
    worst = int((err / bound).argmax())
    assert ratio <= 1.0, f"error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} at {worst}"
    return ratio


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"H{g[0]}-Hkv{g[1]}-D{g[2]}")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_kernel_matches_float64_oracle(
    fmt: str, block_size: int, geometry: tuple[int, int, int], kind: str
) -> None:
    num_heads, num_kv_heads, head_dim = geometry
    q_lens, seq_lens = batch_shape(kind, block_size)
    qb = make_quant_batch(
        fmt,
        q_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=block_size + num_heads,
    )
    scale = head_dim**-0.5
    want = oracle(qb, scale)
    bound = error_bound(qb, scale)
    assert cpu.supports(qb.query, qb.key_cache, qb.value_cache, qb.kv_scales)
    args = (qb.query, qb.key_cache, qb.value_cache, *qb.index_args())
    got = kernels.paged_attention(*args, backend="cpu", kv_scales=qb.kv_scales)
    assert_within(got, want, bound)
    # The backend module directly, into a given out (one thread, then the default).
    out = torch.full_like(qb.query, 7.0)
    before = torch.get_num_threads()
    for threads in (1, before):
        torch.set_num_threads(threads)
        try:
            result = cpu.paged_attention(*args, scale=scale, out=out, kv_scales=qb.kv_scales)
        finally:
            torch.set_num_threads(before)
        assert result is out
        assert_within(out, want, bound)


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_bound_is_tight(fmt: str) -> None:
    """The derived bound is not vacuous: the kernel's error reaches a visible fraction of it
    on a long decode (and stays below it)."""
    qb = make_quant_batch(fmt, [1, 1], [700, 1100], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    scale = 64**-0.5
    got = kernels.paged_attention(qb.query, qb.key_cache, qb.value_cache, *qb.index_args(), kv_scales=qb.kv_scales)
    ratio = assert_within(got, oracle(qb, scale), error_bound(qb, scale))
    assert ratio > 1e-3, f"largest error / bound = {ratio:.2g}: the bound is far from the errors"


def negated(qb: QuantBatch) -> QuantBatch:
    """Another layer over the same block tables: query and V negated (exactly, on the codes)."""

    def neg(cache: torch.Tensor) -> torch.Tensor:
        if cache.dtype == torch.int8:
            return -cache
        return (cache.view(torch.uint8) ^ 0x80).view(cache.dtype)  # fp8: flip the sign bit

    return QuantBatch(
        query=-qb.query,
        key_cache=qb.key_cache,
        value_cache=neg(qb.value_cache),
        kv_scales=qb.kv_scales,
        clean_key_cache=qb.clean_key_cache,
        clean_value_cache=neg(qb.clean_value_cache),
        clean_scales=qb.clean_scales,
        block_tables=qb.block_tables,
        seq_lens=qb.seq_lens,
        cu_seqlens_q=qb.cu_seqlens_q,
        fmt=qb.fmt,
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_prepared_step_reads_quantized_caches(fmt: str) -> None:
    """The serving path: metadata prepared once, then layers with their own caches and scales."""
    first = make_quant_batch(fmt, [1, 5, 1, 3], [77, 40, 1, 9], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    backend = kernels.get_backend(
        torch.device("cpu"), "cpu", dtype=torch.float32, head_dim=64, cache_dtype=first.key_cache.dtype
    )
    meta = backend.prepare(
        torch.full((first.query.shape[0],), -1, dtype=torch.int64),  # nothing to store
        *first.index_args(),
        num_tokens=first.query.shape[0],
        key_cache=first.key_cache,
        value_cache=first.value_cache,
        dtype=torch.float32,
    )
    assert meta.cpu_views is not None and (meta.num_decodes, meta.num_extends) == (2, 2)
    for qb in (first, negated(first)):
        got = backend.paged_attention(qb.query, qb.key_cache, qb.value_cache, meta, kv_scales=qb.kv_scales)
        assert_within(got, oracle(qb, 64**-0.5), error_bound(qb, 64**-0.5))


def test_strided_scales_fall_back_to_the_torch_path() -> None:
    qb = make_quant_batch("int8", [1, 2], [20, 20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    strided = KVScales(
        qb.kv_scales.key.transpose(0, 1).contiguous().transpose(0, 1),
        qb.kv_scales.value.transpose(0, 1).contiguous().transpose(0, 1),
    )
    assert not strided.key.is_contiguous()
    assert not cpu.supports(qb.query, qb.key_cache, qb.value_cache, strided)
    assert not cpu.supports(qb.query, qb.key_cache, qb.value_cache)  # no scales
    clean = KVScales(qb.clean_scales.key, qb.clean_scales.value)
    got = cpu.paged_attention(
        qb.query, qb.clean_key_cache, qb.clean_value_cache, *qb.index_args(), scale=0.125, kv_scales=clean
    )
    assert_within(got, oracle(qb, 0.125), error_bound(qb, 0.125))


# ------------------------------------------------------------------------------ bad input


@pytest.fixture
def int8_batch() -> QuantBatch:
    return make_quant_batch("int8", [1, 1], [20, 5], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)


def test_dispatcher_refuses_missing_or_malformed_scales(int8_batch: QuantBatch) -> None:
    qb = int8_batch
    args = (qb.query, qb.key_cache, qb.value_cache, *qb.index_args())
    with pytest.raises(InvalidArgumentError):
        kernels.paged_attention(*args, backend="cpu")  # no scales
    wrong_dtype = KVScales(qb.kv_scales.key.float(), qb.kv_scales.value)
    with pytest.raises(InvalidArgumentError):
        kernels.paged_attention(*args, backend="cpu", kv_scales=wrong_dtype)
    wrong_shape = KVScales(qb.kv_scales.key, qb.kv_scales.value[:, :8])
    with pytest.raises(InvalidArgumentError):
        kernels.paged_attention(*args, backend="cpu", kv_scales=wrong_shape)


def _core_args(qb: QuantBatch) -> tuple[object, ...]:
    return (
        qb.query.numpy(),
        qb.key_cache.numpy(),
        qb.value_cache.numpy(),
        qb.block_tables.numpy(),
        qb.seq_lens.numpy(),
        qb.cu_seqlens_q.numpy(),
        np.zeros(qb.query.shape, np.float32),
        0.125,
        1,
    )


def test_rust_binding_checks_format_dtypes_and_scales(int8_batch: QuantBatch) -> None:
    qb = int8_batch
    args = _core_args(qb)
    ks = qb.kv_scales.key.view(torch.int16).numpy()
    vs = qb.kv_scales.value.view(torch.int16).numpy()
    assert paged_decode_attention_cpu(*args, kv_format="int8", key_scales=ks, value_scales=vs) == 2
    with pytest.raises(InvalidArgumentError, match="needs key_scales"):
        paged_decode_attention_cpu(*args, kv_format="int8", value_scales=vs)
    with pytest.raises(InvalidArgumentError, match="needs value_scales"):
        paged_decode_attention_cpu(*args, kv_format="int8", key_scales=ks, value_scales=None)
    with pytest.raises(InvalidArgumentError, match="int16"):
        paged_decode_attention_cpu(*args, kv_format="int8", key_scales=ks, value_scales=vs.astype(np.float32))
    with pytest.raises(InvalidArgumentError, match="shape"):
        paged_decode_attention_cpu(*args, kv_format="int8", key_scales=ks[:, :8], value_scales=vs)
    with pytest.raises(InvalidArgumentError, match="shape"):
        paged_decode_attention_cpu(*args, kv_format="int8", key_scales=ks, value_scales=vs[..., None])
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        strided = np.ascontiguousarray(ks.transpose(1, 0, 2)).transpose(1, 0, 2)
        paged_decode_attention_cpu(*args, kv_format="int8", key_scales=strided, value_scales=vs)
    with pytest.raises(InvalidArgumentError, match="kv_format"):
        paged_decode_attention_cpu(*args, kv_format="int4", key_scales=ks, value_scales=vs)
    # The caches' dtype must be the format's: int8 here, not float32 / uint8 (fp8 bytes).
    with pytest.raises(InvalidArgumentError, match="dtype float32"):
        paged_decode_attention_cpu(*args)
    with pytest.raises(InvalidArgumentError, match="uint8"):
        paged_decode_attention_cpu(*args, kv_format="fp8_e4m3", key_scales=ks, value_scales=vs)
    mixed = list(args)
    mixed[2] = qb.value_cache.view(torch.uint8).numpy()
    with pytest.raises(InvalidArgumentError, match="value_cache must have dtype int8"):
        paged_decode_attention_cpu(*mixed, kv_format="int8", key_scales=ks, value_scales=vs)


def test_rust_binding_refuses_scales_for_float32_caches() -> None:
    batch = make_paged_batch([1], [5], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, poison=False)
    ks = np.zeros(batch.key_cache.shape[:3], np.int16)
    args = (
        batch.query.numpy(),
        batch.key_cache.numpy(),
        batch.value_cache.numpy(),
        batch.block_tables.numpy(),
        batch.seq_lens.numpy(),
        batch.cu_seqlens_q.numpy(),
        np.zeros(batch.query.shape, np.float32),
        0.125,
        1,
    )
    assert paged_decode_attention_cpu(*args) == 1
    with pytest.raises(InvalidArgumentError, match="no key_scales"):
        paged_decode_attention_cpu(*args, key_scales=ks, value_scales=ks)


# ------------------------------------------------------------------------------ benchmark


def test_bench_kv_attention_quick_runs(tmp_path: Path) -> None:
    """benches/bench_kv_attention.py --quick runs end to end (so the script cannot rot) and
    leaves RESULTS.md alone."""
    repo = Path(__file__).resolve().parents[2]
    results = repo / "benches" / "RESULTS.md"

    def own_section() -> str | None:  # other benchmarks may rewrite theirs meanwhile
        text = results.read_text() if results.exists() else ""
        start = text.find("<!-- BEGIN KV-cache precision: CPU decode attention")
        return None if start < 0 else text[start : text.find("<!-- END KV-cache precision", start)]

    before = own_section()
    proc = subprocess.run(
        [sys.executable, str(repo / "benches" / "bench_kv_attention.py"), "--quick"],
        cwd=tmp_path,
        env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for dtype in ("float32", "int8", "fp8_e4m3", "fp8_e5m2"):
        assert f"| {dtype} |" in proc.stdout, dtype
    assert "of copy bandwidth (target >= 60%" in proc.stdout
    assert own_section() == before
