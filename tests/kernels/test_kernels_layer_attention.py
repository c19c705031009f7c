"""Sliding-window, chunked-local, soft-capped and sink layers in the torch path (the oracle
and the CPU backend) against transformers' own mask functions and eager formulas
(``paged_batches.layer_reference``), with the blocks no query can see filled with NaN: they
must never be read."""

from __future__ import annotations

import pytest
import torch
from paged_batches import PagedBatch, causal_reference, layer_reference, make_paged_batch, poison_blocks_before

from pagedkv.attention_span import first_visible
from pagedkv.errors import InvalidArgumentError, InvalidTypeError
from pagedkv.kernels import paged_attention, reference, triton_attention
from pagedkv.kernels.kv_quant import SCALE_DTYPE, KVScales
from pagedkv.kernels.layer_attention import FULL_ATTENTION, LayerAttention, describe_layers
from pagedkv.kernels.triton_attention import DecodeConfig, DecodeWorkspace, PrefillConfig

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


def _sinks(seed: int = 0) -> torch.Tensor:
    return torch.randn(NUM_HEADS, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


LAYERS = {
    # windows smaller and larger than a block (8), edges on and off block boundaries
    "window-3": LayerAttention(sliding_window=3),
    "window-8": LayerAttention(sliding_window=8),
    "window-13": LayerAttention(sliding_window=13),
    "window-1": LayerAttention(sliding_window=1),
    "chunk-8": LayerAttention(chunk_size=8),
    "chunk-12": LayerAttention(chunk_size=12),
    "window-5-and-chunk-16": LayerAttention(sliding_window=5, chunk_size=16),
    "soft-cap": LayerAttention(logits_soft_cap=0.5),
    "sinks": LayerAttention(sinks=_sinks()),
    "window-7-soft-cap-sinks": LayerAttention(sliding_window=7, logits_soft_cap=1.5, sinks=_sinks(1)),
}

# (q_lens, seq_lens): decodes at and around block edges, a long prefill, extends whose first
# query starts mid-block, a sequence shorter than every window, more queries than keys.
BATCHES = {
    "decodes": ([1, 1, 1, 1, 1, 1], [1, 7, 8, 9, 23, 61]),
    "mixed": ([1, 37, 1, 9, 5], [40, 37, 2, 50, 21]),
    "short-and-empty-rows": ([6, 1], [4, 8]),
}


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_torch_path_equals_transformers_masks_and_formulas(layer_name: str, batch_name: str) -> None:
    layer = LAYERS[layer_name]
    q_lens, seq_lens = BATCHES[batch_name]
    batch = make_paged_batch(
        q_lens, seq_lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=8,
        dtype=torch.float64, seed=len(layer_name),
    )  # fmt: skip
    expected = layer_reference(batch, layer)
    poisoned = poison_blocks_before(batch, layer)
    if layer.limits_context and batch_name != "short-and-empty-rows":
        assert poisoned > 0, "the batch has no block behind a window: the test would not see a stray read"
    got = reference.paged_attention(*batch.attention_args(), layer=layer)
    assert torch.isfinite(got).all(), "a block no query sees was read"
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_a_window_wider_than_every_sequence_is_full_attention() -> None:
    batch = make_paged_batch(
        [1, 9, 1], [5, 30, 31], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float64
    )
    wide = reference.paged_attention(*batch.attention_args(), layer=LayerAttention(sliding_window=1000))
    torch.testing.assert_close(wide, causal_reference(batch), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_the_first_visible_key_is_one_rule_for_scalars_and_tensors(layer_name: str) -> None:
    layer = LAYERS[layer_name]
    positions = torch.arange(0, 70)
    scalar = [first_visible(p, layer.sliding_window, layer.chunk_size) for p in positions.tolist()]
    assert layer.first_visible_tensor(positions).tolist() == scalar
    assert [layer.first_visible(p) for p in positions.tolist()] == scalar


def test_decode_chunks_count_only_the_window() -> None:
    """Decode sequences are batched by what they gather: with a window, long sequences cost
    their window, not their length (the gather budget packs them together)."""
    batch = make_paged_batch(
        [1] * 6, [300, 290, 280, 270, 260, 250], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
        dtype=torch.float64, seed=2,
    )  # fmt: skip
    layer = LayerAttention(sliding_window=16)
    expected = layer_reference(batch, layer)
    poison_blocks_before(batch, layer)
    got = reference.paged_attention(*batch.attention_args(), layer=layer)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_public_dispatch_takes_the_layer(backend: str) -> None:
    """``kernels.paged_attention(..., layer=...)`` on the CPU backends, float32 (the engine's
    dtype): the cpu backend's decodes run in the Rust kernel, its extends in the torch path."""
    batch = make_paged_batch(
        [1, 11, 1],
        [26, 30, 17],
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=8,
        seed=4,
    )
    layer = LayerAttention(sliding_window=6, logits_soft_cap=2.0, sinks=_sinks(2).float())
    expected = layer_reference(
        batch.as_dtype(torch.float64), LayerAttention(sliding_window=6, logits_soft_cap=2.0, sinks=_sinks(2))
    )
    assert _drop_keys_before(batch, layer, whole_blocks=True) > 0  # NaN and -1 entries behind the window
    got = paged_attention(*batch.attention_args(), layer=layer, backend=backend)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_full_attention_is_the_default_and_unchanged() -> None:
    batch = make_paged_batch(
        [1, 7, 1], [30, 20, 9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float64
    )
    assert FULL_ATTENTION.is_full and not FULL_ATTENTION.limits_context
    default = reference.paged_attention(*batch.attention_args())
    explicit = reference.paged_attention(*batch.attention_args(), layer=FULL_ATTENTION)
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sliding_window": 0}, InvalidArgumentError, "sliding_window must be >= 1"),
        ({"chunk_size": -4}, InvalidArgumentError, "chunk_size must be >= 1"),
        ({"sliding_window": True}, InvalidTypeError, "sliding_window must be an int"),
        ({"sliding_window": 4.0}, InvalidTypeError, "sliding_window must be an int"),
        ({"logits_soft_cap": 0.0}, InvalidArgumentError, "logits_soft_cap must be a finite number > 0"),
        ({"logits_soft_cap": float("inf")}, InvalidArgumentError, "logits_soft_cap must be a finite number > 0"),
        ({"logits_soft_cap": "30"}, InvalidTypeError, "logits_soft_cap must be a float"),
        ({"sinks": torch.zeros(2, 3)}, InvalidArgumentError, "sinks must be a 1-D floating tensor"),
        ({"sinks": torch.zeros(4, dtype=torch.int64)}, InvalidArgumentError, "sinks must be a 1-D floating tensor"),
        ({"sinks": [0.0, 1.0]}, InvalidTypeError, "sinks must be a torch.Tensor"),
    ],
)
def test_bad_layer_values_are_typed_errors(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        LayerAttention(**kwargs)


def test_sinks_of_the_wrong_head_count_are_refused() -> None:
    batch = make_paged_batch([1], [5], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    with pytest.raises(InvalidArgumentError, match="sinks has 3 logits but the query has 4 heads"):
        paged_attention(*batch.attention_args(), layer=LayerAttention(sinks=torch.zeros(3)), backend="torch")


@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_rust_decode_kernel_equals_the_oracle(layer_name: str) -> None:
    """The Rust decode kernel (``_core.paged_decode_attention_cpu``) under every variant, on
    decodes whose blocks behind the window are NaN and whose table entries there are -1 (what
    a sliding-window group leaves): it reads neither."""
    from pagedkv._core import paged_decode_attention_cpu
    from pagedkv.kernels.cpu import _variant

    oracle_layer = LAYERS[layer_name]
    layer = LayerAttention(
        sliding_window=oracle_layer.sliding_window,
        chunk_size=oracle_layer.chunk_size,
        logits_soft_cap=oracle_layer.logits_soft_cap,
        sinks=None if oracle_layer.sinks is None else oracle_layer.sinks.float(),
    )
    q_lens, seq_lens = BATCHES["decodes"]
    batch = make_paged_batch(
        q_lens, seq_lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=8, seed=9
    )
    expected = layer_reference(batch.as_dtype(torch.float64), oracle_layer)
    poison_blocks_before(batch, layer)
    tables = batch.block_tables.clone()
    for b, seq_len in enumerate(seq_lens):
        tables[b, : layer.first_visible(seq_len - 1) // 8] = -1
    out = torch.zeros_like(batch.query)
    written = paged_decode_attention_cpu(
        batch.query.numpy(), batch.key_cache.numpy(), batch.value_cache.numpy(), tables.numpy(),
        batch.seq_lens.numpy(), batch.cu_seqlens_q.numpy(), out.numpy(), HEAD_DIM**-0.5, 2, **_variant(layer),
    )  # fmt: skip
    assert written == len(seq_lens)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_rust_kernel_refuses_bad_variants() -> None:
    from pagedkv._core import paged_decode_attention_cpu

    batch = make_paged_batch([1], [5], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    args = (
        batch.query.numpy(), batch.key_cache.numpy(), batch.value_cache.numpy(), batch.block_tables.numpy(),
        batch.seq_lens.numpy(), batch.cu_seqlens_q.numpy(), torch.zeros_like(batch.query).numpy(), 0.25, 1,
    )  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="sinks has 3 logits but the query has 4 heads"):
        paged_decode_attention_cpu(*args, sinks=torch.zeros(3).numpy())
    with pytest.raises(InvalidArgumentError, match="sliding_window and chunk_size must be >= 1"):
        paged_decode_attention_cpu(*args, sliding_window=0)
    with pytest.raises(InvalidArgumentError, match="logits_soft_cap must be a finite number > 0"):
        paged_decode_attention_cpu(*args, logits_soft_cap=-1.0)


# --- Triton kernels ---------------------------------------------------------------------------
# The same layers in the Triton decode (split-KV) and prefill/extend kernels, in the interpreter
# on the CPU (compiled on a GPU: the batches are built and checked on the CPU, run on DEVICE). Tiles of 16 keys over blocks of 8 (the smallest tl.dot allows): a window skips
# whole key tiles, so a kernel that starts its loop anywhere but the first visible tile, or
# loads a key below the first visible one, reads a -1 table entry or a NaN.

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_DECODE = DecodeConfig(block_n=16, num_warps=4, num_stages=1)
TRITON_PREFILL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def _float32_layer(layer: LayerAttention) -> LayerAttention:
    """``layer`` with float32 sinks (the kernels' compute dtype; the oracle keeps float64)."""
    return LayerAttention(
        sliding_window=layer.sliding_window,
        chunk_size=layer.chunk_size,
        logits_soft_cap=layer.logits_soft_cap,
        sinks=None if layer.sinks is None else layer.sinks.float(),
    )


def _drop_keys_before(
    batch: PagedBatch, layer: LayerAttention, kv_scales: KVScales | None = None, *, whole_blocks: bool = False
) -> int:
    """What a sliding-window KV cache group leaves of each sequence: every key below the first
    one its earliest query sees is NaN (in a quantized cache its scales), the rows before it in
    that key's own block too unless ``whole_blocks`` (the Triton kernels load nothing below it;
    the torch path reads whole blocks from there), and the table entries of the blocks wholly
    before it are -1. Returns how many entries were set to -1."""
    block_size = batch.key_cache.shape[1]
    dropped = 0
    for b, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens.tolist())):
        first = layer.first_visible(max(0, seq_len - q_len))
        for position in range(first // block_size * block_size if whole_blocks else first):
            block, row = int(batch.block_tables[b, position // block_size]), position % block_size
            for cache in (
                (batch.key_cache, batch.value_cache) if kv_scales is None else (kv_scales.key, kv_scales.value)
            ):
                cache[block, row] = float("nan")
        batch.block_tables[b, : first // block_size] = -1
        dropped += first // block_size
    return dropped


def _run_triton_layer(
    batch: PagedBatch,
    layer: LayerAttention,
    *,
    num_splits: int = 2,
    use_decode_kernel: bool = True,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:  # [T, H, D]
    """The Triton kernels on ``batch`` (moved to DEVICE) with NaN-filled output and workspace."""
    args = [t.to(DEVICE) for t in batch.attention_args()]
    if kv_scales is not None:
        kv_scales = KVScales(kv_scales.key.to(DEVICE), kv_scales.value.to(DEVICE))
    query = args[0]
    workspace = DecodeWorkspace.allocate(
        len(batch.q_lens), query.shape[1], num_splits, query.shape[2], query.device, fill=float("nan")
    )
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention(
        *args, scale=query.shape[2] ** -0.5, out=out, max_seqlen_q=max(batch.q_lens), num_splits=num_splits,
        workspace=workspace if num_splits > 1 else None, use_decode_kernel=use_decode_kernel,
        decode_config=TRITON_DECODE, prefill_config=TRITON_PREFILL, kv_scales=kv_scales, layer=layer,
    )  # fmt: skip
    return out.cpu()


# (layer, batch, num_splits, use_decode_kernel): every layer on the mixed batch (decodes in the
# split-KV kernel, extends and a prefill from scratch in the prefill kernel); the rows that see
# no key and the single-split epilogue on the variants that change the softmax; the prefill
# kernel doing decode rows itself under a window.
TRITON_CASES = [(name, "mixed", 2, True) for name in LAYERS] + [
    ("window-7-soft-cap-sinks", "short-and-empty-rows", 1, True),
    ("sinks", "short-and-empty-rows", 2, True),
    ("window-3", "decodes", 1, False),
    ("chunk-12", "decodes", 3, True),
]


@pytest.mark.parametrize(("layer_name", "batch_name", "num_splits", "use_decode_kernel"), TRITON_CASES)
def test_triton_kernels_equal_transformers_masks_and_formulas(
    layer_name: str, batch_name: str, num_splits: int, use_decode_kernel: bool
) -> None:
    oracle_layer = LAYERS[layer_name]
    q_lens, seq_lens = BATCHES[batch_name]
    batch = make_paged_batch(
        q_lens, seq_lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=8,
        seed=len(layer_name),
    )  # fmt: skip
    expected = layer_reference(batch.as_dtype(torch.float64), oracle_layer)
    dropped = _drop_keys_before(batch, oracle_layer)
    if oracle_layer.limits_context and batch_name != "short-and-empty-rows":
        assert dropped > 0, "the batch has no block behind a window: the test would not see a stray read"
    got = _run_triton_layer(
        batch, _float32_layer(oracle_layer), num_splits=num_splits, use_decode_kernel=use_decode_kernel
    )
    assert torch.isfinite(got).all(), "a dropped key or an unwritten output / workspace entry was read"
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_triton_int8_cache_with_a_window_soft_cap_and_sinks() -> None:
    """An int8 cache (scales folded in registers) under a variant, against the float64 oracle
    on the same quantized cache; the scales of the dropped keys are NaN, their entries -1."""
    oracle_layer = LAYERS["window-7-soft-cap-sinks"]
    q_lens, seq_lens = BATCHES["mixed"]
    batch = make_paged_batch(
        q_lens, seq_lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=8, seed=5,
        poison=False,
    )  # fmt: skip
    shape = batch.key_cache.shape
    key_cache, value_cache = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    kv_scales = KVScales(
        torch.full(shape[:3], float("nan"), dtype=SCALE_DTYPE), torch.full(shape[:3], float("nan"), dtype=SCALE_DTYPE)
    )
    slots = [
        int(batch.block_tables[b, j // 8]) * 8 + j % 8 for b, seq_len in enumerate(seq_lens) for j in range(seq_len)
    ]
    reference.store_kv(
        torch.cat(batch.keys), torch.cat(batch.values), key_cache, value_cache, torch.tensor(slots), kv_scales=kv_scales
    )
    batch.key_cache, batch.value_cache = key_cache, value_cache
    expected = reference.paged_attention(
        batch.query.double(), *batch.attention_args()[1:], kv_scales=kv_scales, layer=oracle_layer
    )
    assert _drop_keys_before(batch, oracle_layer, kv_scales) > 0
    got = _run_triton_layer(batch, _float32_layer(oracle_layer), kv_scales=kv_scales)
    assert torch.isfinite(got).all(), "a dropped key's scale was read"
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_triton_full_attention_layer_is_the_plain_kernel() -> None:
    """``FULL_ATTENTION`` and a window wider than every sequence give the plain kernels' result
    bit for bit in the interpreter (the same tiles, the same order of operations; a GPU
    compiler may schedule the two programs' arithmetic differently)."""
    q_lens, seq_lens = BATCHES["mixed"]
    batch = make_paged_batch(
        q_lens, seq_lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=8, seed=6
    )
    plain = _run_triton_layer(batch, FULL_ATTENTION)
    wide = _run_triton_layer(batch, LayerAttention(sliding_window=1000))
    exact = DEVICE == "cpu"
    torch.testing.assert_close(wide, plain, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)
    torch.testing.assert_close(plain.double(), causal_reference(batch.as_dtype(torch.float64)), rtol=0, atol=1e-5)


def test_triton_backend_takes_the_layer_and_refuses_bad_sinks() -> None:
    """The public dispatch runs the layer on the triton backend, with -1 table entries behind
    the window (its validation knows the layer), and keeps the typed errors: sinks of the wrong
    head count, a -1 entry the window does reach."""
    batch = make_paged_batch([1, 11, 1], [26, 30, 17], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=4)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    oracle_layer = LayerAttention(sliding_window=6, logits_soft_cap=2.0, sinks=sinks)
    expected = layer_reference(batch.as_dtype(torch.float64), oracle_layer)
    assert _drop_keys_before(batch, oracle_layer) > 0
    layer = _float32_layer(oracle_layer)
    args = [t.to(DEVICE) for t in batch.attention_args()]
    got = paged_attention(*args, layer=layer, backend="triton")
    torch.testing.assert_close(got.double().cpu(), expected, rtol=0, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="sinks has 3 logits but the query has 4 heads"):
        paged_attention(*args, layer=LayerAttention(sinks=torch.zeros(3)), backend="triton")
    if DEVICE == "cpu":  # values are checked on the host only
        with pytest.raises(InvalidArgumentError, match="block_tables holds block id -1 for a used block"):
            paged_attention(*args, layer=LayerAttention(sliding_window=40), backend="triton")


def test_describe_layers_counts_each_kind() -> None:
    sliding = LayerAttention(sliding_window=512)
    assert describe_layers([sliding] * 5 + [FULL_ATTENTION] + [sliding] * 10 + [FULL_ATTENTION] * 2) == (
        "15 sliding window 512 + 3 full"
    )
    capped = [LayerAttention(sliding_window=4096, logits_soft_cap=50.0), LayerAttention(logits_soft_cap=50.0)]
    assert describe_layers(capped * 2) == "2 sliding window 4096, soft-cap 50 + 2 full, soft-cap 50"
    sinks = torch.zeros(4)
    assert (
        describe_layers([LayerAttention(chunk_size=8192), LayerAttention(sinks=sinks)])
        == "1 chunk 8192 + 1 full, sinks"
    )
