"""The kernels' dispatcher: backend selection, lazy Triton import, argument validation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from paged_batches import make_paged_batch

import pagedkv.kernels as kernels
from pagedkv.errors import ConfigError, InvalidArgumentError

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"
# Tests run the triton backend on CUDA tensors when there is a GPU, else on CPU tensors under the
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _run_python(code: str, **env_overrides: str) -> subprocess.CompletedProcess[str]:
    env = os.environ.copy()
    tests_dir = str(Path(__file__).resolve().parents[1])  # paged_batches
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PYTHON_DIR), tests_dir, env.get("PYTHONPATH", "")) if p)
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def batch():
    return make_paged_batch(
        [1, 3], [10, 20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, poison=False, device=DEVICE
    )


# --- backend selection -------------------------------------------------------------------------


def test_auto_picks_cpu_on_cpu_and_triton_on_cuda(monkeypatch):
    monkeypatch.delenv(kernels.BACKEND_ENV_VAR, raising=False)
    assert kernels.resolve_backend(torch.device("cpu")) == "cpu"
    assert kernels.resolve_backend(torch.device("cpu"), dtype=torch.float32) == "cpu"
    assert kernels.resolve_backend(torch.device("cpu"), dtype=torch.float64) == "torch"
    with pytest.raises(InvalidArgumentError):
        kernels.resolve_backend(torch.device("cuda"), "cpu")
    assert kernels.resolve_backend(torch.device("cuda")) == "triton"  # triton is installed here
    # auto falls back to the torch path for what the kernels do not support
    assert kernels.resolve_backend(torch.device("cuda"), dtype=torch.float64, head_dim=128) == "torch"
    assert kernels.resolve_backend(torch.device("cuda"), dtype=torch.bfloat16, head_dim=48) == "torch"
    assert kernels.resolve_backend(torch.device("cuda"), dtype=torch.bfloat16, head_dim=128) == "triton"


def test_environment_variable_and_keyword(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "torch")
    assert kernels.resolve_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, " Triton ")
    assert kernels.resolve_backend(torch.device("cuda")) == "triton"
    if INTERPRETED:
        assert kernels.resolve_backend(torch.device("cpu")) == "triton"
    assert kernels.resolve_backend(torch.device("cpu"), "torch") == "torch"  # keyword wins
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "cuda")
    with pytest.raises(ConfigError, match="'cuda'"):
        kernels.resolve_backend(torch.device("cpu"))
    with pytest.raises(InvalidArgumentError, match="'flash'"):
        kernels.resolve_backend(torch.device("cpu"), "flash")


def test_environment_variable_selects_the_kernel(monkeypatch, batch):
    """The env var really routes the call: the triton path rejects float64, the torch path takes it."""
    wide = batch.as_dtype(torch.float64)
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "triton")
    with pytest.raises(InvalidArgumentError, match="not supported by the triton backend"):
        kernels.paged_attention(*wide.attention_args())
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "torch")
    assert kernels.paged_attention(*wide.attention_args()).dtype == torch.float64


def test_torch_path_never_imports_triton():
    result = _run_python(
        """
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        import torch
        import pagedkv.kernels as kernels
        from pagedkv.errors import ConfigError
        from paged_batches import make_paged_batch
        b = make_paged_batch([1, 2], [5, 9], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8)
        out = kernels.paged_attention(*b.attention_args())
        kernels.store_kv(b.keys[0], b.values[0], b.key_cache, b.value_cache, torch.arange(5))
        assert torch.isfinite(out).all()
        assert not any(name.startswith("pagedkv.kernels.triton") for name in sys.modules), sorted(sys.modules)
        try:
            kernels.paged_attention(*b.attention_args(), backend="triton")
        except ConfigError as exc:
            print("ConfigError:", exc)
        """,
        PAGEDKV_ATTENTION_BACKEND="auto",
    )
    assert result.returncode == 0, result.stderr
    assert "ConfigError: the triton backend needs the `triton` package" in result.stdout


def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    result = _run_python(
        """
        import pagedkv.kernels as kernels
        from pagedkv.errors import InvalidArgumentError
        from paged_batches import make_paged_batch
        b = make_paged_batch([1], [5], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8)
        try:
            kernels.paged_attention(*b.attention_args(), backend="triton")
        except InvalidArgumentError as exc:
            print("InvalidArgumentError:", exc)
        """,
        TRITON_INTERPRET="0",
    )
    assert result.returncode == 0, result.stderr
    assert "InvalidArgumentError: the triton backend got tensors on cpu" in result.stdout
    assert "TRITON_INTERPRET=1" in result.stdout


# --- validation --------------------------------------------------------------------------------


def _replace(args: tuple, index: int, value) -> tuple:
    return (*args[:index], value, *args[index + 1 :])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_shape_and_dtype_errors(batch, backend):
    args = batch.attention_args()
    q, kc, vc, bt, sl, cu = args
    cases = [
        (_replace(args, 0, q[0]), "query must be 3-D"),
        (_replace(args, 2, vc[:, :, :1]), "value_cache shape"),
        (_replace(args, 2, vc.half()), "value_cache dtype"),
        (_replace(args, 0, q[:, :3]), r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
        (_replace(args, 0, q[..., :32]), "query head_dim 32 differs"),
        (_replace(args, 0, q.long()), "query dtype torch.int64 is not supported"),
        (_replace(args, 0, q.half()), "cache dtype torch.float32 must equal query dtype torch.float16"),
        (_replace(args, 3, bt.long()), "block_tables must be torch.int32, got torch.int64"),
        (_replace(args, 3, bt[0]), "block_tables must be 2-D"),
        (_replace(args, 4, sl[:1]), "seq_lens needs 2 entries"),
        (_replace(args, 5, cu[:2]), r"cu_seqlens_q 3 \(has 2\)"),
        (_replace(args, 4, sl.to("meta")), "all tensors must be on one device"),
        (_replace(args, 5, [0, 1, 4]), "cu_seqlens_q must be a torch.Tensor, got list"),
    ]
    for bad_args, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            kernels.paged_attention(*bad_args, backend=backend)
    with pytest.raises(InvalidArgumentError, match="scale must be a finite number"):
        kernels.paged_attention(*args, scale=float("nan"), backend=backend)
    with pytest.raises(InvalidArgumentError, match="out must match query"):
        kernels.paged_attention(*args, out=torch.empty_like(q).half(), backend=backend)


@pytest.mark.parametrize("block_size", [4, 12])
def test_block_size_must_be_a_power_of_two_of_at_least_8(block_size):
    b = make_paged_batch([1], [5], num_heads=2, num_kv_heads=1, head_dim=64, block_size=block_size)
    with pytest.raises(InvalidArgumentError, match=f"power of two >= 8, got {block_size}"):
        kernels.paged_attention(*b.attention_args())
    with pytest.raises(InvalidArgumentError, match=f"power of two >= 8, got {block_size}"):
        kernels.store_kv(b.keys[0], b.values[0], b.key_cache, b.value_cache, torch.arange(5))


def test_head_dim_support_differs_by_backend():
    b = make_paged_batch(
        [1, 2], [5, 9], num_heads=2, num_kv_heads=1, head_dim=48, block_size=8, poison=False, device=DEVICE
    )
    assert torch.isfinite(kernels.paged_attention(*b.attention_args(), backend="torch")).all()
    with pytest.raises(InvalidArgumentError, match=r"head_dim 48 is not supported by the triton backend"):
        kernels.paged_attention(*b.attention_args(), backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_batch_value_errors_on_cpu(batch, backend):
    if backend == "triton" and not INTERPRETED:
        pytest.skip("value checks run on CPU tensors only; the triton backend takes CPU tensors under the interpreter")
    batch = (
        batch
        if DEVICE == "cpu"
        else make_paged_batch([1, 3], [10, 20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, poison=False)
    )
    args = batch.attention_args()
    q, kc, vc, bt, sl, cu = args
    decreasing = torch.tensor([0, 3, 1], dtype=torch.int32)  # CPU tensors: value checks apply
    too_long = torch.tensor([0, 1, 9], dtype=torch.int32)
    over_capacity = torch.tensor([10, bt.shape[1] * 16 + 1], dtype=torch.int32)
    bad_block = bt.clone()
    bad_block[1, 0] = kc.shape[0]
    unused_padding = bt.clone()
    unused_padding[0, 1:] = 10_000  # past sequence 0's only block: never read, so allowed
    cases = [
        (_replace(args, 5, decreasing), "non-decreasing; it falls from 3 to 1 at sequence 1"),
        (_replace(args, 5, too_long), "cu_seqlens_q ends at 9, past the 4 query rows"),
        (_replace(args, 4, over_capacity), r"seq_lens\[1\] = 49 is outside 0 .. 48"),
        (_replace(args, 3, bad_block), f"block id {kc.shape[0]} for a used block"),
    ]
    for bad_args, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            kernels.paged_attention(*bad_args, backend=backend)
    torch.testing.assert_close(
        kernels.paged_attention(*_replace(args, 3, unused_padding), backend=backend),
        kernels.paged_attention(*args, backend="torch"),
        rtol=0,
        atol=1e-5,
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_errors(batch, backend):
    key, value = batch.keys[0], batch.values[0]  # [10, 2, 64]
    kc, vc = batch.key_cache, batch.value_cache
    slots = torch.arange(10, device=DEVICE)
    cases = [
        ((key, value, kc, vc, slots.int()), "slot_mapping must be torch.int64, got torch.int32"),
        ((key, value, kc, vc, slots[:4]), "slot_mapping has 4 entries but key has 10 tokens"),
        ((key[:, :1], value[:, :1], kc, vc, slots), r"key has \(num_kv_heads, head_dim\) = \(1, 64\)"),
        ((key, value[:5], kc, vc, slots), "value shape"),
        ((key, value.half(), kc, vc, slots), "value dtype"),
        ((key.half(), value.half(), kc, vc, slots), "cache dtype torch.float32 must equal key dtype torch.float16"),
        ((key, value, kc, vc.to("meta"), slots), "all tensors must be on one device"),
        ((key.cpu().numpy(), value, kc, vc, slots), "key must be a torch.Tensor, got ndarray"),
    ]
    if DEVICE == "cpu":  # value check: CPU tensors only (no device sync)
        cases.append(((key, value, kc, vc, slots + kc.shape[0] * 16), "slot_mapping holds slot"))
    for bad_args, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            kernels.store_kv(*bad_args, backend=backend)


def test_errors_are_value_errors_for_vllm_style_callers(batch):
    with pytest.raises(ValueError):
        kernels.paged_attention(*_replace(batch.attention_args(), 3, batch.block_tables.long()))


# --- the serving path: backend resolved once, metadata prepared once per step ---------------------


def _prepared_backends() -> list[str]:
    return ["torch", "cpu"] + (["triton"] if INTERPRETED or DEVICE == "cuda" else [])


def _host_batch(**kwargs):
    """A mixed batch (decodes, an extend, a prefill) with host index tensors, caches on DEVICE."""
    b = make_paged_batch(
        [1, 4, 1, 7], [33, 20, 1, 7], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, poison=False, **kwargs
    )
    return b


@pytest.mark.parametrize("backend", _prepared_backends())
def test_prepared_backend_matches_the_public_functions(backend, monkeypatch):
    device = "cpu" if backend == "cpu" else DEVICE
    b = _host_batch(device=device)
    host = {name: getattr(b, name).cpu() for name in ("block_tables", "seq_lens", "cu_seqlens_q")}
    num_tokens = b.query.shape[0]
    # New K/V for the query rows, with a skipped token (-1) in the middle.
    generator = torch.Generator().manual_seed(3)
    key = torch.randn(num_tokens, 2, 64, generator=generator).to(device)
    value = torch.randn(num_tokens, 2, 64, generator=generator).to(device)
    free_slots = torch.arange(b.key_cache.shape[0] * 16 - num_tokens, b.key_cache.shape[0] * 16)
    slots = free_slots.clone()
    slots[5] = -1

    want_k, want_v = b.key_cache.clone(), b.value_cache.clone()
    kernels.store_kv(key, value, want_k, want_v, slots.to(device), backend=backend)
    # A layer variant too: the public function and the backend share one execution path.
    layer = kernels.LayerAttention(sliding_window=9, sinks=torch.randn(4, generator=generator).to(device))
    want = kernels.paged_attention(
        b.query, want_k, want_v, b.block_tables, b.seq_lens, b.cu_seqlens_q, backend=backend, scale=0.3, layer=layer
    )

    attention = kernels.get_backend(torch.device(device), backend, dtype=torch.float32, head_dim=64)
    assert attention.name == backend
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "not-a-backend")  # never read again
    meta = attention.prepare(
        slots,
        host["block_tables"],
        host["seq_lens"],
        host["cu_seqlens_q"],
        num_tokens=num_tokens,
        key_cache=b.key_cache,
        value_cache=b.value_cache,
        dtype=torch.float32,
    )
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.num_decodes, meta.num_extends) == (7, 33, 2, 2)
    assert meta.block_tables.device == b.key_cache.device and meta.block_tables.is_contiguous()
    assert (meta.cpu_views is not None) == (backend == "cpu")
    got_k, got_v = b.key_cache.clone(), b.value_cache.clone()
    attention.store_kv(key, value, got_k, got_v, meta)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    got = attention.paged_attention(b.query, got_k, got_v, meta, scale=0.3, layer=layer)
    # On the host both build the same metadata, so the same kernels run: equal bit for bit (on a
    # GPU the public call has no host facts, so its decode split count may differ).
    exact = b.query.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)
    assert not torch.equal(got, attention.paged_attention(b.query, got_k, got_v, meta, scale=0.3))
    out = torch.full_like(b.query, 7.0)
    assert attention.paged_attention(b.query, got_k, got_v, meta, scale=0.3, out=out, layer=layer) is out
    torch.testing.assert_close(out, want, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)


def test_cpu_backend_runs_short_query_runs_as_decodes():
    """Sequences of up to CPU_KERNEL_MAX_QUERY query rows (speculative decoding's rows) go to
    the Rust decode kernel as one-row sequences, longer ones to the torch path: the reference's
    result either way, with a window and sinks too."""
    b = make_paged_batch(
        [1, 5, 20, 17, 1], [40, 12, 30, 50, 1], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, poison=False
    )
    n = b.query.shape[0]
    attention = kernels.get_backend(torch.device("cpu"), "cpu", dtype=torch.float32, head_dim=64)
    meta = attention.prepare(
        torch.full((n,), -1, dtype=torch.int64),
        b.block_tables,
        b.seq_lens,
        b.cu_seqlens_q,
        num_tokens=n,
        key_cache=b.key_cache,
        value_cache=b.value_cache,
        dtype=torch.float32,
    )
    assert meta.cpu_long_rows == [2] and meta.cpu_num_kernel_rows == 1 + 5 + 17 + 1
    generator = torch.Generator().manual_seed(5)
    for layer in (
        kernels.FULL_ATTENTION,
        kernels.LayerAttention(sliding_window=7, sinks=torch.randn(4, generator=generator)),
    ):
        got = attention.paged_attention(b.query, b.key_cache, b.value_cache, meta, scale=0.2, layer=layer)
        want = kernels.reference.paged_attention(
            b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, scale=0.2, layer=layer
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prepare_validates_the_step_once_and_layers_only_by_shape():
    b = _host_batch()
    attention = kernels.get_backend(torch.device("cpu"), "cpu")
    slots = torch.arange(b.query.shape[0], dtype=torch.int64)
    base = dict(num_tokens=b.query.shape[0], key_cache=b.key_cache, value_cache=b.value_cache, dtype=torch.float32)
    args = (slots, b.block_tables, b.seq_lens, b.cu_seqlens_q)
    bad_block = b.block_tables.clone()
    bad_block[1, 0] = b.key_cache.shape[0]
    cases = [
        (_replace(args, 0, slots[:3]), "slot_mapping has 3 entries but the step has 13 tokens"),
        (_replace(args, 0, slots + b.key_cache.shape[0] * 16), "slot_mapping holds slot"),
        (_replace(args, 1, bad_block), "block id"),
        (_replace(args, 1, b.block_tables.long()), "block_tables must be torch.int32"),
        (_replace(args, 3, torch.tensor([0, 4, 1, 2, 13], dtype=torch.int32)), "non-decreasing"),
        (_replace(args, 2, b.seq_lens[:2]), "seq_lens needs 4 entries"),
    ]
    for bad, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            attention.prepare(*bad, **base)
    with pytest.raises(InvalidArgumentError, match="query dtype torch.float16 is not supported|cache dtype"):
        attention.prepare(*args, **{**base, "dtype": torch.float16})

    meta = attention.prepare(*args, **base)
    kc, vc = b.key_cache, b.value_cache
    key = torch.zeros(b.query.shape[0], 2, 64)
    with pytest.raises(InvalidArgumentError, match=r"key must be a torch.float32 \(13, 2, 64\)"):
        attention.store_kv(key[:5], key[:5], kc, vc, meta)
    with pytest.raises(InvalidArgumentError, match="value must be"):
        attention.store_kv(key, key.double(), kc, vc, meta)
    with pytest.raises(InvalidArgumentError, match="key_cache must be"):
        attention.store_kv(key, key, kc[:-1], vc, meta)
    with pytest.raises(InvalidArgumentError, match="query must be"):
        attention.paged_attention(b.query[:, :3], kc, vc, meta)
    with pytest.raises(InvalidArgumentError, match="query must be"):
        attention.paged_attention(b.query[:-1], kc, vc, meta)
    with pytest.raises(InvalidArgumentError, match="scale must be a finite number"):
        attention.paged_attention(b.query, kc, vc, meta, scale=float("inf"))
    with pytest.raises(InvalidArgumentError, match="out must match query"):
        attention.paged_attention(b.query, kc, vc, meta, out=torch.empty(1))


def test_get_backend_refuses_what_the_backend_cannot_run(monkeypatch):
    monkeypatch.delenv(kernels.BACKEND_ENV_VAR, raising=False)
    with pytest.raises(InvalidArgumentError, match="head_dim 48 is not supported by the triton backend"):
        kernels.get_backend(torch.device("cuda"), "triton", dtype=torch.float16, head_dim=48)
    with pytest.raises(InvalidArgumentError, match="cpu backend got tensors on cuda"):
        kernels.get_backend(torch.device("cuda"), "cpu")
    assert kernels.get_backend(torch.device("cuda"), None, dtype=torch.float16, head_dim=48).name in ("torch",)
