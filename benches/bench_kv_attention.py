"""CPU decode attention per KV-cache dtype: float32 against int8, fp8 e4m3 and fp8
e5m2 caches (one bfloat16 scale per token and KV head, dequantized on the fly by the Rust
kernel, rust/cpu_attention.rs).

SmolLM2 geometry (9 query heads, 3 KV heads, head_dim 64), block size 16, 64 sequences of 2048
tokens each decoding one token, block tables shuffled (a sequence's blocks are scattered over
the pool, as after a while of serving). Per dtype: the median time of one
``pagedkv.kernels.cpu.paged_attention`` call on ``torch.get_num_threads()`` threads, the KV
bytes it must read (data + scales of every position) per second, that rate as a share of this
machine's memory copy bandwidth (a 256 MiB ``torch`` ``copy_``, measured in the same run,
counted as bytes read + bytes written like STREAM's copy), and the speed-up over float32. The
dtypes are interleaved round by round, and every cache is larger than the last-level cache of
a typical CPU, so each call reads its KV from memory, as each layer of a serving step does.

Targets: int8 at least 2x faster than float32, and at least 60% of the copy
bandwidth. The last column is the same kernel on 4 sequences called repeatedly, whose KV stays
in the last-level cache: the rate its arithmetic allows with memory out of the way.

    python benches/bench_kv_attention.py [--quick] [--write] [--repeats N]

`--quick` is a smoke run on tiny shapes; it never writes RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import add_write_flag, md_table, write_section

from pagedkv.kernels import cpu, kv_quant

DTYPES = ["float32", "int8", "fp8_e4m3", "fp8_e5m2"]
SECTION = "KV-cache precision: CPU decode attention (issue 10)"


def make_caches(
    num_seqs: int, context: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int = 0
) -> dict[str, tuple[torch.Tensor, torch.Tensor, kv_quant.KVScales | None]]:
    """The same random K/V in every dtype: (key_cache, value_cache, scales) per dtype name."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = num_seqs * context // block_size
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=generator)
    value = torch.randn(shape, generator=generator)
    caches: dict[str, tuple[torch.Tensor, torch.Tensor, kv_quant.KVScales | None]] = {"float32": (key, value, None)}
    for name in DTYPES[1:]:
        fmt = kv_quant.FORMATS[name]
        (kq, ks), (vq, vs) = (kv_quant.quantize_kv(x.view(-1, num_kv_heads, head_dim), fmt) for x in (key, value))
        scales = kv_quant.KVScales(ks.view(shape[:3]), vs.view(shape[:3]))
        caches[name] = (kq.view(shape), vq.view(shape), scales)
    return caches


def kv_bytes(key: torch.Tensor, value: torch.Tensor, scales: kv_quant.KVScales | None) -> int:
    """Bytes of K/V data and scales (every slot is read once: the batch owns every block)."""
    total = key.numel() * key.element_size() + value.numel() * value.element_size()
    if scales is not None:
        total += scales.key.numel() * scales.key.element_size() + scales.value.numel() * scales.value.element_size()
    return total


def copy_bandwidth(mib: int, repeats: int) -> float:
    """GB/s of a `mib` MiB torch copy_ (read + write bytes), median over `repeats`."""
    src = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(samples) / 1e9


def time_dtypes(
    num_seqs: int,
    context: int,
    repeats: int,
    *,
    interleaved: bool,
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds of each call by dtype, and the KV bytes a call reads. `interleaved`: one call per
    dtype per round (each call follows another dtype's: its KV comes from memory); else all
    calls of a dtype in a row (a KV that fits the last-level cache stays there)."""
    caches = make_caches(num_seqs, context, num_kv_heads, head_dim, block_size)
    generator = torch.Generator().manual_seed(1)
    num_blocks = num_seqs * context // block_size
    tables = torch.randperm(num_blocks, generator=generator).to(torch.int32).view(num_seqs, -1)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    out = torch.empty_like(query)
    scale = head_dim**-0.5
    calls: dict[str, Callable[[], object]] = {}
    for name, (key, value, scales) in caches.items():
        assert cpu.supports(query, key, value, scales), name

        def call(key: torch.Tensor = key, value: torch.Tensor = value, scales: object = scales) -> object:
            return cpu.paged_attention(query, key, value, tables, lens, cu, scale=scale, out=out, kv_scales=scales)

        calls[name] = call
    # The quantized results against float32's: a sanity check that each path ran.
    outputs = {}
    for name, call in calls.items():
        call()
        outputs[name] = out.clone()
    for name in DTYPES[1:]:
        rel = float((outputs[name] - outputs["float32"]).norm() / outputs["float32"].norm())
        assert rel < 0.1, f"{name}: relative difference {rel} to float32"
    samples: dict[str, list[float]] = {name: [] for name in calls}
    order = (
        [name for _ in range(repeats) for name in calls] if interleaved else [n for n in calls for _ in range(repeats)]
    )
    for name in order:
        start = time.perf_counter()
        calls[name]()
        samples[name].append(time.perf_counter() - start)
    return samples, {name: kv_bytes(*caches[name]) for name in caches}


def run(
    num_seqs: int, context: int, repeats: int, copy_mib: int, resident_seqs: int
) -> tuple[list[list[object]], dict[str, float], float]:
    """(table rows, speed-up over float32 by dtype, copy GB/s)."""
    samples, nbytes = time_dtypes(num_seqs, context, repeats, interleaved=True)
    copy = copy_bandwidth(copy_mib, max(3, repeats // 2))
    resident, resident_bytes = time_dtypes(resident_seqs, context, repeats, interleaved=False)
    seconds = {name: statistics.median(s) for name, s in samples.items()}
    # Speed-up: the median of per-round ratios (a burst of other work on the machine slows one
    # round of every dtype, not one dtype).
    speedups = {name: statistics.median(f / t for f, t in zip(samples["float32"], samples[name])) for name in samples}
    rows: list[list[object]] = []
    for name in samples:
        rate = nbytes[name] / seconds[name] / 1e9
        rows.append(
            [
                name,
                f"{nbytes[name] / 2**20:.1f}",
                seconds[name] * 1e3,
                min(samples[name]) * 1e3,
                rate,
                f"{100 * rate / copy:.0f}%",
                speedups[name],
                resident_bytes[name] / statistics.median(resident[name]) / 1e9,
            ]
        )
    return rows, speedups, copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke run); never writes RESULTS.md")
    add_write_flag(ap)
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per dtype (default 40; quick: 3)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.quick:
        num_seqs, context, copy_mib, resident_seqs, repeats = 4, 256, 16, 2, args.repeats or 3
    else:
        num_seqs, context, copy_mib, resident_seqs, repeats = 64, 2048, 256, 4, args.repeats or 40
    threads = torch.get_num_threads()
    print(f"{num_seqs} sequences x {context} tokens, 9/3 heads, head_dim 64, block 16, {threads} threads", flush=True)
    rows, speedups, copy = run(num_seqs, context, repeats, copy_mib, resident_seqs)
    headers = [
        "KV dtype",
        "KV MiB read",
        "ms / call (median)",
        "ms (min)",
        "KV GB/s",
        "of copy bandwidth",
        "x float32",
        f"KV GB/s, cache-resident ({resident_seqs} seqs)",
    ]
    table = md_table(headers, rows)
    print(table)
    int8 = next(r for r in rows if r[0] == "int8")
    speedup, share = speedups["int8"], float(int8[4]) / copy
    verdict = (
        f"Memory copy bandwidth: {copy:.1f} GB/s (torch copy_ of {copy_mib} MiB, read + write bytes).\n"
        f"int8: {speedup:.2f}x float32 (target >= 2x: {'met' if speedup >= 2 else 'NOT met'}), "
        f"{100 * share:.0f}% of copy bandwidth (target >= 60%: {'met' if share >= 0.6 else 'NOT met'}).\n"
        f"With its KV resident in the last-level cache ({resident_seqs} sequences, calls in a row) int8 "
        f"reads {float(int8[7]):.1f} GB/s: the ceiling of the kernel's arithmetic on {torch.get_num_threads()} "
        "threads, whatever the memory."
    )
    print(verdict)
    if not args.no_write and not args.quick:
        body = (
            f"CPU decode attention (`pagedkv.kernels.cpu.paged_attention`, Rust kernel): {num_seqs} sequences x "
            f"{context} tokens, SmolLM2 geometry (9 query heads, 3 KV heads, head_dim 64), block size 16, "
            f"shuffled block tables, {threads} threads; {repeats} rounds of one call per dtype (interleaved). "
            "KV GB/s: bytes of K/V data + bfloat16 scales / median time; x float32: median over rounds of "
            "(float32 time / this dtype's time).\n\n" + table + "\n\n" + verdict + "\n"
        )
        write_section(SECTION, "python benches/bench_kv_attention.py", body)


if __name__ == "__main__":
    main()
