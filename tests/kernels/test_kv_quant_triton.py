"""Quantized KV caches (int8, fp8 e4m3, fp8 e5m2) in the Triton kernels, against torch.

On the CPU the kernels run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET``);
on a GPU they are compiled (e4m3 only from compute capability 8.9 on).

* **store**: Triton ``store_kv`` against ``reference.store_kv`` (the torch path of
  :mod:`pagedkv.kernels.kv_quant`): scales and data equal bit for bit (rounding ties go to
  even in both, ``-0.0`` keeps its sign); the round trip ``dequantize(store(x))`` within
  ``KVFormat.error_bound``; untouched slots untouched; static scales saturate at ``qmax``.
* **attention**: Triton ``paged_attention`` on a quantized cache against the float64 oracle
  ``reference.paged_attention(query.double(), ..., kv_scales=...)`` on the *same* cache, so
  quantization error does not enter the comparison: the tolerance is the float32 (and fp16)
  arithmetic of the kernel, bounded per output element by :func:`_arithmetic_bound` (derived
  there; the observed errors stay below a quarter of it in fp32). fp32 queries for the whole
  matrix, fp16 ones where the V scales could underflow fp16.

Shapes are small (head_dim 64, two KV heads) and the interpreter's tiles large: the whole file
runs in well under a minute on two cores.
"""

from __future__ import annotations

import math

import pytest
import torch
from paged_batches import make_paged_batch

import pagedkv.kernels as kernels
from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels import reference, triton_attention, triton_store
from pagedkv.kernels.kv_quant import (
    FORMATS,
    SCALE_DTYPE,
    KVFormat,
    KVScales,
    check_static_scale,
    compute_scales,
    dequantize,
    quantize_kv,
)
from pagedkv.kernels.triton_attention import DecodeWorkspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMAT_NAMES = list(FORMATS)  # int8, fp8_e4m3, fp8_e5m2
HEAD_DIM = 64
NUM_KV_HEADS = 2


def _fmt(name: str) -> KVFormat:
    if name == "fp8_e4m3" and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 e4m3 needs compute capability >= 8.9 in Triton")
    return FORMATS[name]


# --- caches ----------------------------------------------------------------------------------


def _poison_byte(fmt: KVFormat) -> int:
    """A byte a correct store never writes and a read shows: NaN for float8, -128 for int8."""
    return 0x7F if fmt.is_float else 0x80


def _poisoned_cache(fmt: KVFormat, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    """(key_cache, value_cache, KVScales): data full of the poison byte, scales NaN."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, _poison_byte(fmt), dtype=torch.uint8, device=DEVICE).view(fmt.storage_dtype)
    value_cache = key_cache.clone()
    nan = torch.full(shape[:3], float("nan"), dtype=SCALE_DTYPE, device=DEVICE)
    return key_cache, value_cache, KVScales(nan, nan.clone())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


# --- store -----------------------------------------------------------------------------------


def _store_inputs(num_tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[T, Hkv, D]`` with the hard cases in their first rows, random magnitudes after."""
    generator = torch.Generator().manual_seed(seed)
    finfo = torch.finfo(dtype)
    x = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    # every (token, head) vector at its own magnitude: 2^-20 .. 2^20 (fp16: 2^-8 .. 2^8)
    spread = 8 if dtype == torch.float16 else 20
    x[:, 6:] *= torch.exp2(
        torch.randint(-spread, spread + 1, (2, num_tokens - 6, NUM_KV_HEADS, 1), generator=generator)
    )
    x[:, 0] = 0.0  # zero vectors: scale 2^-126, zeros stored
    x[:, 1, 0, 5] = 3e3  # one outlier: the rest of its vector falls to few grid steps (fp8 subnormals)
    x[:, 1, 1] = -x[:, 1, 1].abs()  # all negative, some -0.0 below
    x[:, 1, 1, ::7] = -0.0
    x[:, 2] = finfo.max * (2 * torch.rand(2, NUM_KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64) - 1)
    x[:, 2, :, 3] = finfo.max  # near the input dtype's limit: a scale near max / qmax
    tiny = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    if dtype == torch.bfloat16:  # the interpreter upcasts bf16 subnormals wrongly: normals only
        tiny = tiny.sign() * (1 + tiny.abs())
    x[:, 3] = finfo.tiny * tiny  # absmax / qmax below 2^-126: the scale is clamped
    x[:, 4] = 1e-40 if dtype == torch.float32 else finfo.tiny  # subnormal / tiny: scale clamped at 2^-126
    # values exactly on the rounding boundaries of the grid (x / scale = k + 0.5 for int8)
    x[:, 5] = (torch.arange(HEAD_DIM, dtype=torch.float64) - 31.5).expand(2, NUM_KV_HEADS, HEAD_DIM)
    x[:, 5, :, 0] = 127.0
    x = x.to(dtype)
    return x[0].to(DEVICE), x[1].to(DEVICE)


def _check_store(fmt: KVFormat, key, value, slots, block_size: int, static: tuple | None = None):
    num_blocks = 4
    got_k, got_v, got_scales = _poisoned_cache(fmt, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    exp_k, exp_v, exp_scales = _poisoned_cache(fmt, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    if static is not None:  # (static_key, static_value)
        got_scales = KVScales(got_scales.key, got_scales.value, *static)
        exp_scales = KVScales(exp_scales.key, exp_scales.value, *static)
    triton_store.store_kv(key, value, got_k, got_v, slots, kv_scales=got_scales)
    reference.store_kv(key, value, exp_k, exp_v, slots, kv_scales=exp_scales)

    # Untouched slots are untouched (poison in both); written ones agree.
    assert torch.equal(_bits(got_scales.key), _bits(exp_scales.key))
    assert torch.equal(_bits(got_scales.value), _bits(exp_scales.value))
    kept = slots >= 0
    flat = slots[kept].long()
    for x, got, exp, scales, static_scale in (
        (key, got_k, exp_k, got_scales.key, got_scales.static_key),
        (value, got_v, exp_v, got_scales.value, got_scales.static_value),
    ):
        unwritten = torch.ones(got.shape[0] * got.shape[1], dtype=torch.bool, device=DEVICE)
        unwritten[flat] = False
        assert (_bits(got).flatten(0, 1)[unwritten] == _poison_byte(fmt)).all()
        assert scales.flatten(0, 1)[unwritten].isnan().all()
        stored = got.flatten(0, 1)[flat]  # [N, Hkv, D]
        stored_scales = scales.flatten(0, 1)[flat]  # [N, Hkv]
        rows = x[kept]
        assert torch.equal(stored_scales.float(), compute_scales(rows, fmt, static_scale))
        # Bit for bit, even on rounding ties (both round half to even) and for -0.0.
        assert torch.equal(_bits(stored), _bits(exp.flatten(0, 1)[flat]))

        # Round trip: within half a grid step; a static scale saturates at +-qmax instead.
        restored = dequantize(stored, stored_scales, torch.float64)
        error = (restored - rows.double()).abs()
        bound = fmt.error_bound(rows.double().abs(), stored_scales.double()[..., None])
        saturated = rows.double().abs() > fmt.qmax * stored_scales.double()[..., None]
        if static_scale is None:
            assert not bool(saturated.any())
        ok = (error <= bound) | saturated
        assert bool(ok.all()), f"{int((~ok).sum())} values off by more than half a grid step"
        limit = (fmt.qmax * stored_scales.double()[..., None]).expand_as(rows)
        assert torch.equal(restored[saturated], limit[saturated] * rows.double()[saturated].sign())
    return got_scales


# Each input dtype once and each block size at least once (the kernel's indexing depends on the
# block size, its casts on the dtype; the two do not interact).
@pytest.mark.parametrize(
    ("dtype", "block_size"), [(torch.float32, 16), (torch.float16, 32), (torch.bfloat16, 16), (torch.float32, 32)]
)
@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_store_matches_torch_and_round_trips(fmt_name, dtype, block_size):
    fmt = _fmt(fmt_name)
    num_tokens = 40
    key, value = _store_inputs(num_tokens, dtype, seed=block_size)
    generator = torch.Generator().manual_seed(7)
    slots = torch.randperm(4 * block_size, generator=generator)[:num_tokens]
    slots[9::6] = -1  # skipped tokens (none of the hard cases)
    _check_store(fmt, key, value, slots.to(DEVICE), block_size)


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_store_static_scales_saturate(fmt_name):
    """Checkpoint scales: every slot gets the head's scale (rounded up to bf16), values past
    ``qmax * scale`` saturate; per-head scales, different for K and V."""
    fmt = _fmt(fmt_name)
    key, value = _store_inputs(24, torch.float32, seed=3)
    key, value = key[5:].clone(), value[5:].clone()
    key[:, :, :8] *= 1e4  # well past qmax * scale: saturates
    static_key = check_static_scale("k_scale", [0.01, 0.3], NUM_KV_HEADS).to(DEVICE)
    static_value = check_static_scale("v_scale", 1.0 / 3.0, NUM_KV_HEADS).to(DEVICE)  # rounded up to bf16
    slots = torch.arange(key.shape[0], device=DEVICE) * 3
    scales = _check_store(fmt, key, value, slots, 16, static=(static_key, static_value))
    for head in range(NUM_KV_HEADS):
        assert (scales.key.flatten(0, 1)[slots, head].float() == static_key[head]).all()
    assert static_value[0] > 1.0 / 3.0  # rounded up to bfloat16
    assert (scales.value.flatten(0, 1)[slots].float() == static_value[0]).all()
    saturated = key[:, :, :8].abs() > fmt.qmax * static_key[None, :, None]
    assert int(saturated.sum()) > 10  # the test saturates


def test_store_into_strided_scale_caches():
    """Data and scales as views of pools (one layer, K and V interleaved): strides honoured."""
    fmt = FORMATS["int8"]
    key, value = _store_inputs(12, torch.float32, seed=5)
    data_pool = torch.zeros(2, 3, 16, 2, NUM_KV_HEADS, HEAD_DIM, dtype=torch.int8, device=DEVICE)
    scale_pool = torch.full((2, 3, 16, 2, NUM_KV_HEADS), float("nan"), dtype=SCALE_DTYPE, device=DEVICE)
    scales = KVScales(scale_pool[1, :, :, 0], scale_pool[1, :, :, 1])
    slots = torch.tensor([0, 17, -1, 47, 8, 9, 31, 32, -1, 1, 2, 3], device=DEVICE)
    triton_store.store_kv(key, value, data_pool[1, :, :, 0], data_pool[1, :, :, 1], slots, kv_scales=scales)
    expected_k, expected_v = quantize_kv(key, fmt), quantize_kv(value, fmt)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, 16)
        assert torch.equal(data_pool[1, block, row, 0], expected_k[0][t])
        assert torch.equal(data_pool[1, block, row, 1], expected_v[0][t])
        assert torch.equal(scale_pool[1, block, row, 0], expected_k[1][t])
        assert torch.equal(scale_pool[1, block, row, 1], expected_v[1][t])
    assert (data_pool[0] == 0).all() and scale_pool[0].isnan().all()
    assert int(scale_pool[1].isnan().sum()) == (3 * 16 - 10) * 2 * NUM_KV_HEADS


def test_quantized_cache_needs_scales_and_float_cache_takes_none():
    key = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    int8_k, int8_v, scales = _poisoned_cache(FORMATS["int8"], 1, 16, NUM_KV_HEADS, HEAD_DIM)
    float_cache = torch.zeros(1, 16, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(InvalidArgumentError, match="needs kv_scales"):
        triton_store.store_kv(key, key, int8_k, int8_v, slots)
    with pytest.raises(InvalidArgumentError, match="takes no kv_scales"):
        triton_store.store_kv(key, key, float_cache, float_cache, slots, kv_scales=scales)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.tensor([0, 1]))
    query = torch.randn(1, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    with pytest.raises(InvalidArgumentError, match="needs kv_scales"):
        triton_attention.paged_attention(query, int8_k, int8_v, *args, scale=1.0, out=query.clone())


# --- attention -------------------------------------------------------------------------------

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _gamma(n: torch.Tensor | float) -> torch.Tensor | float:
    """Higham's gamma_n = n u / (1 - n u) for float32: the bound on the relative error of a
    sum or dot product of n terms (any order)."""
    u = UNIT_ROUNDOFF[torch.float32]
    return n * u / (1 - n * u)


def _arithmetic_bound(
    query: torch.Tensor,  # [T, H, D] (the kernel's and the oracle's query, exactly)
    keys: list[torch.Tensor],  # per sequence [seq_len, Hkv, D] float64: the dequantized cache
    values: list[torch.Tensor],
    q_lens: list[int],
    scale: float,
    num_splits: int,
) -> torch.Tensor:  # [T, H, D] float64
    """A first-order bound on ``|kernel - oracle|`` per output element when both read the same
    quantized cache.

    The kernel's operands are exact: ``q`` is the oracle's query, ``k_raw.to(q.dtype)`` and the
    bf16 scales are exact in float32, and the oracle dequantizes ``k_raw * k_scale`` exactly in
    float64. What is left is the kernel's float32 arithmetic (``u = 2^-24``, ``gamma(n) = n u /
    (1 - n u)``). For query row ``i`` with exact softmax weights ``w_j`` (``sum_j w_j = 1``)
    over its ``n`` visible keys, exact output ``o`` and ``D`` dims:

    * score: ``q . k_raw_j`` (a dot of ``D`` terms) times ``fl(k_scale_j * scale * log2 e)``,
      rounded: off by ``gamma(D + 3) * scale * sum_d |q_d k_jd|`` (natural-log units: the
      ``log2 e`` cancels); ``s_j - m`` (the running max) is rounded relative to itself, a
      weight error ``u * ln 2 * |s_j - m|`` (base 2, bounded with the final max); the base-2
      exponential and the products with the rescaling factors add a few ``u`` per weight
      (8u here; the GPU's ``ex2.approx`` is within 2 ulp). So ``w_j`` carries a relative error
      ``|e_j| <= rho_j`` (the sum of these);
    * such perturbed weights move the normalised output by ``|sum_j w_j e_j (v_j - o)| / (1 -
      max rho) <= sum_j w_j rho_j |v_j - o| (1 + 2 max rho)``;
    * ``sum_j p_j v_j`` and ``l = sum_j p_j``, accumulated over ``n`` keys and merged over up to
      ``num_splits`` partial results: ``gamma(n + num_splits + 4) * (sum_j w_j |v_j| + |o|)``;
    * the PV weights cast to the query's dtype: fp32 queries take ``p_j * v_scale_j`` exactly;
      fp16 queries take ``p_j * v_scale_j / s <= p_j`` (``s`` the running max of the V scales,
      the PV product times ``s``), rounded by a relative ``u_q = 2^-11`` and, where fp16 is
      subnormal, an absolute ``2^-25`` (``tiny_q``) times ``|v_raw| * s <= (1 + 2^-7) max_j
      |v_j|`` (the bf16 scales are rounded up); the output is rounded to the query's dtype
      (``u_q`` relative, ``tiny_q`` absolute): ``u_q * (sum_j w_j |v_j| + |o|) + n * tiny_q *
      (1 + 2^-7) * max_j |v_j| + tiny_q``.

    (bf16 queries, GPU only, are checked against the 16-bit tolerance in
    test_kernels_attention.py.)
    """
    u = UNIT_ROUNDOFF[torch.float32]
    u_q = 0.0 if query.dtype == torch.float32 else UNIT_ROUNDOFF[query.dtype]
    tiny_q = (
        0.0 if query.dtype == torch.float32 else torch.finfo(query.dtype).smallest_normal * u_q
    )  # half a subnormal step
    q = query.double().cpu()
    head_dim = q.shape[-1]
    bound = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for q_len, k, v in zip(q_lens, keys, values):
        seq_len, group = k.shape[0], q.shape[1] // k.shape[1]
        k_h = k.cpu().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq_len, D]
        v_h = v.cpu().repeat_interleave(group, dim=1).transpose(0, 1)
        q_h = q[row : row + q_len].transpose(0, 1)  # [H, q_len, D]
        visible = torch.arange(seq_len)[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
        scores = torch.where(visible, scale * q_h @ k_h.transpose(1, 2), -math.inf)  # [H, q_len, seq_len]
        sees_a_key = visible.any(dim=-1)[None, :, None]
        weights = torch.where(sees_a_key, torch.softmax(scores, dim=-1), 0.0)
        out = weights @ v_h  # [H, q_len, D]
        below_max = torch.where(visible, scores.amax(dim=-1, keepdim=True) - scores, 0.0) / math.log(2)
        rho = _gamma(head_dim + 3) * scale * (q_h.abs() @ k_h.abs().transpose(1, 2)) + u * math.log(2) * below_max
        rho = torch.where(visible, rho + 8 * u, 0.0)
        spread = (v_h[:, None, :, :] - out[:, :, None, :]).abs()  # [H, q_len, seq_len, D]
        softmax_term = ((weights * rho)[..., None] * spread).sum(dim=2) * (1 + 2 * rho.amax())
        magnitude = weights @ v_h.abs() + out.abs()
        n = visible.sum(dim=-1).double()[None, :, None]
        largest = torch.where(visible[None, :, :, None], v_h.abs()[:, None], 0.0).amax(dim=2)  # [H, q_len, D]
        underflow = n * tiny_q * (1 + 2.0**-7) * largest + tiny_q
        element_bound = softmax_term + (_gamma(n + num_splits + 4) + u_q) * magnitude + underflow
        bound[row : row + q_len] = element_bound.transpose(0, 1)
        row += q_len
    return bound


def _layout(kind: str, block_size: int) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens) of one batch kind; contexts end on, before and after block edges."""
    if kind == "decode":
        return [1] * 6, [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 7, 75]
    if kind == "extend":  # a cached prefix, ending mid-block / on a block edge
        return [9, 20], [9 + block_size + 3, 20 + 2 * block_size]
    if kind == "prefill":
        return [37, 12], [37, 12]
    assert kind == "mixed"
    return [1, 13, 1, 40, 7], [37, 13, block_size, 40 + block_size + 5, 7 + 2 * block_size]


def _quantized_batch(fmt: KVFormat, q_lens, seq_lens, *, group: int, block_size: int, dtype, seed: int, v_gain=1.0):
    """A packed batch (``make_paged_batch``) whose K/V are stored quantized, poison elsewhere.

    The K/V vectors get magnitudes 2^-2 .. 2^2 (so their scales differ from token to token);
    one K vector and one V vector are zero and one K vector has an outlier. Returns the batch,
    its quantized caches and scales, and the dequantized K/V per sequence (float64).
    """
    batch = make_paged_batch(
        q_lens,
        seq_lens,
        num_heads=group * NUM_KV_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=block_size,
        dtype=torch.float32,
        device=DEVICE,
        seed=seed,
        poison=False,
    )
    generator = torch.Generator().manual_seed(seed + 1)
    keys, values = torch.cat(batch.keys).cpu(), torch.cat(batch.values).cpu() * v_gain
    keys *= torch.exp2(torch.randint(-2, 3, (keys.shape[0], NUM_KV_HEADS, 1), generator=generator).float())
    values *= torch.exp2(torch.randint(-2, 3, (keys.shape[0], NUM_KV_HEADS, 1), generator=generator).float())
    keys[0, 0] = 0.0
    values[-1, 1] = 0.0
    keys[keys.shape[0] // 2, 1, 3] = 12.0
    tables, slots = batch.block_tables.cpu(), []
    for b, seq_len in enumerate(seq_lens):
        slots += [int(tables[b, j // block_size]) * block_size + j % block_size for j in range(seq_len)]
    key_cache, value_cache, kv_scales = _poisoned_cache(
        fmt, batch.key_cache.shape[0], block_size, NUM_KV_HEADS, HEAD_DIM
    )
    reference.store_kv(
        keys.to(DEVICE),
        values.to(DEVICE),
        key_cache,
        value_cache,
        torch.tensor(slots, device=DEVICE),
        kv_scales=kv_scales,
    )
    k_data, k_scale = quantize_kv(keys, fmt)
    v_data, v_scale = quantize_kv(values, fmt)
    deq_k, deq_v = dequantize(k_data, k_scale, torch.float64), dequantize(v_data, v_scale, torch.float64)
    splits = [sum(seq_lens[:b]) for b in range(len(seq_lens) + 1)]
    per_seq_k = [deq_k[splits[b] : splits[b + 1]] for b in range(len(seq_lens))]
    per_seq_v = [deq_v[splits[b] : splits[b + 1]] for b in range(len(seq_lens))]
    cache_args = (key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    return batch.query.to(dtype), cache_args, kv_scales, (per_seq_k, per_seq_v)


def _attend(query, cache_args, kv_scales, q_lens, *, num_splits, use_decode_kernel=True):
    out = torch.full_like(query, float("nan"))
    workspace = None
    if num_splits > 1:
        workspace = DecodeWorkspace.allocate(
            len(q_lens), query.shape[1], num_splits, query.shape[2], query.device, fill=float("nan")
        )
    triton_attention.paged_attention(
        query,
        *cache_args,
        scale=HEAD_DIM**-0.5,
        out=out,
        max_seqlen_q=max(q_lens),
        num_splits=num_splits,
        workspace=workspace,
        use_decode_kernel=use_decode_kernel,
        kv_scales=kv_scales,
    )
    return out


def _check_attention(got, query, cache_args, kv_scales, dequantized, q_lens, num_splits) -> None:
    assert torch.isfinite(got).all(), "non-finite output: a poisoned slot, scale or workspace entry was read"
    expected = reference.paged_attention(query.double(), *cache_args, scale=HEAD_DIM**-0.5, kv_scales=kv_scales)
    bound = _arithmetic_bound(query, *dequantized, q_lens, HEAD_DIM**-0.5, num_splits).to(got.device)
    error = (got.double() - expected).abs()
    worst = int((error - bound).flatten().argmax())
    assert bool((error <= bound).all()), f"error {error.flatten()[worst]:.3e} > bound {bound.flatten()[worst]:.3e}"


# Block size and GQA group size paired (each value of each once per format and kind): the
# kernel's block loop and its head grouping are independent of each other.
@pytest.mark.parametrize(("block_size", "group"), [(16, 1), (32, 3)])
@pytest.mark.parametrize("kind", ["decode", "extend", "prefill", "mixed"])
@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_attention_matches_oracle_on_the_same_quantized_cache(fmt_name, kind, block_size, group):
    fmt = _fmt(fmt_name)
    q_lens, seq_lens = _layout(kind, block_size)
    seed = block_size + 3 * group + FORMAT_NAMES.index(fmt_name)
    query, cache_args, kv_scales, dequantized = _quantized_batch(
        fmt, q_lens, seq_lens, group=group, block_size=block_size, dtype=torch.float32, seed=seed
    )
    # decode: the kernel's own epilogue (1 split) and the merge (3); mixed: both kernels.
    num_splits = {"decode": 1 if group == 1 else 3, "mixed": 2}.get(kind, 1)
    got = _attend(query, cache_args, kv_scales, q_lens, num_splits=num_splits)
    _check_attention(got, query, cache_args, kv_scales, dequantized, q_lens, num_splits)
    if kind == "decode" and group == 3:  # the same rows through the prefill kernel
        got = _attend(query, cache_args, kv_scales, q_lens, num_splits=1, use_decode_kernel=False)
        _check_attention(got, query, cache_args, kv_scales, dequantized, q_lens, 1)


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_attention_fp16_query_small_values(fmt_name):
    """fp16 queries and V of magnitude ~1e-3: the V scales (down to 1e-3 / 57344 in e5m2) are
    folded into the fp16 softmax weights with a power-of-two factor that keeps them normal."""
    fmt = _fmt(fmt_name)
    q_lens, seq_lens = _layout("mixed", 16)
    query, cache_args, kv_scales, dequantized = _quantized_batch(
        fmt, q_lens, seq_lens, group=2, block_size=16, dtype=torch.float16, seed=21, v_gain=1e-3
    )
    got = _attend(query, cache_args, kv_scales, q_lens, num_splits=2)
    _check_attention(got, query, cache_args, kv_scales, dequantized, q_lens, 2)


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_store_then_attend_through_the_dispatcher(fmt_name):
    """The serving path: Triton store_kv into strided per-layer views, then Triton attention,
    both through ``pagedkv.kernels`` with ``kv_scales``; equal to the torch backend's."""
    fmt = _fmt(fmt_name)
    q_lens, seq_lens, block_size = [1, 6, 1], [20, 6, 33], 16
    batch = make_paged_batch(
        q_lens, seq_lens, num_heads=4, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=block_size, seed=31
    )
    num_blocks = batch.key_cache.shape[0]
    pool = torch.zeros(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=fmt.storage_dtype, device=DEVICE)
    scale_pool = torch.zeros(num_blocks, block_size, 2, NUM_KV_HEADS, dtype=SCALE_DTYPE, device=DEVICE)
    kv_scales = KVScales(scale_pool[:, :, 0], scale_pool[:, :, 1])
    tables, slots = batch.block_tables.cpu(), []
    for b, seq_len in enumerate(seq_lens):
        slots += [int(tables[b, j // block_size]) * block_size + j % block_size for j in range(seq_len)]
    slot_mapping = torch.tensor(slots, device=DEVICE)
    keys, values = torch.cat(batch.keys), torch.cat(batch.values)
    kernels.store_kv(keys, values, pool[0], pool[1], slot_mapping, kv_scales=kv_scales, backend="triton")
    expected_k, expected_s = quantize_kv(keys, fmt)
    assert torch.equal(_bits(pool[0].flatten(0, 1)[slot_mapping]), _bits(expected_k))
    assert torch.equal(scale_pool[:, :, 0].flatten(0, 1)[slot_mapping], expected_s)

    args = (batch.query, pool[0], pool[1], batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    got = kernels.paged_attention(*args, kv_scales=kv_scales, backend="triton")
    expected = reference.paged_attention(batch.query.double(), *args[1:], kv_scales=kv_scales)
    assert torch.isfinite(got).all()
    per_seq = [sum(seq_lens[:b]) for b in range(len(seq_lens) + 1)]
    deq_k = dequantize(expected_k, expected_s, torch.float64)
    v_data, v_scale = quantize_kv(values, fmt)
    deq_v = dequantize(v_data, v_scale, torch.float64)
    bound = _arithmetic_bound(
        batch.query,
        [deq_k[per_seq[b] : per_seq[b + 1]] for b in range(len(seq_lens))],
        [deq_v[per_seq[b] : per_seq[b + 1]] for b in range(len(seq_lens))],
        q_lens,
        HEAD_DIM**-0.5,
        triton_attention._MAX_SPLITS,
    ).to(got.device)
    assert bool(((got.double() - expected).abs() <= bound).all())
