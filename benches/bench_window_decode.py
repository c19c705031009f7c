"""CPU decode attention with a sliding window reads the window only.

Gemma 3 270M's attention geometry (4 query heads, 1 KV head, head_dim 256), float32 KV, blocks
of 16, 32 sequences decoding one token each, every block of every sequence scattered over one
shared pool (as after a while of serving). Three calls of ``pagedkv.kernels.cpu.paged_attention``
(the Rust kernel), interleaved round by round, each timed as the median of its rounds:

* ``512 full``: 512-token contexts, full attention;
* ``8k window 512``: 8,192-token contexts, a 512-token window (the sequences' blocks are all
  still in the pool: what a cache that keeps every layer whole holds);
* ``8k full``: 8,192-token contexts, full attention (what the window saves).

Target: ``8k window 512`` within 1.3x of ``512 full`` (the window is all it reads).

    python benches/bench_window_decode.py [--rounds N] [--quick] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import add_write_flag, md_table, write_section  # noqa: E402

from pagedkv.kernels import LayerAttention, cpu  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 1, 256, 16
TARGET = 1.3


def tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def scattered_tables(num_seqs: int, context: int, pool_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """[num_seqs, blocks per sequence] int32: distinct random blocks of the pool."""
    per_seq = -(-context // BLOCK_SIZE)
    ids = torch.randperm(pool_blocks, generator=generator)[: num_seqs * per_seq]
    return ids.view(num_seqs, per_seq).to(torch.int32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a smoke run; never writes")
    add_write_flag(parser)
    args = parser.parse_args()
    num_seqs, long_context, short_context, window = (4, 512, 64, 64) if args.quick else (32, 8192, 512, 512)
    generator = torch.Generator().manual_seed(0)
    pool_blocks = num_seqs * long_context // BLOCK_SIZE + num_seqs
    shape = (pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=generator)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    cases = {
        f"{tokens(short_context)} full": (short_context, LayerAttention()),
        f"{tokens(long_context)} window {window}": (long_context, LayerAttention(sliding_window=window)),
        f"{tokens(long_context)} full": (long_context, LayerAttention()),
    }
    calls = {}
    for name, (context, layer) in cases.items():
        tables = scattered_tables(num_seqs, context, pool_blocks, generator)
        lens = torch.full((num_seqs,), context, dtype=torch.int32)
        out = torch.empty_like(query)

        def call(tables=tables, lens=lens, out=out, layer=layer) -> None:
            cpu.paged_attention(query, key_cache, value_cache, tables, lens, cu, scale=scale, out=out, layer=layer)

        call()
        calls[name] = call
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = medians[next(iter(cases))]
    rows = [[name, f"{m * 1e3:.3f}", f"{m / base:.2f}x"] for name, m in medians.items()]
    names = list(medians)
    windowed = medians[names[1]] / base
    verdict = "met" if windowed <= TARGET else "NOT met"
    body = (
        f"{num_seqs} sequences, {NUM_HEADS} query heads / {NUM_KV_HEADS} KV head / head_dim {HEAD_DIM} (Gemma 3 270M), "
        f"float32 KV, blocks of {BLOCK_SIZE} scattered over a {pool_blocks:,}-block pool, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds.\n\n"
        + md_table(["call", "ms", "vs short full"], rows)
        + f"\n\n{names[1]} / {names[0]}: **{windowed:.2f}x** (target <= {TARGET}x): {verdict}.\n"
    )
    print(body)
    if not args.no_write and not args.quick:
        write_section(
            "window_decode",
            "python benches/bench_window_decode.py --write",
            body,
            heading="## Sliding-window decode on the CPU (issue 25)",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
