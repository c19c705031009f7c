"""Per-call cost of the Rust core through the Python bindings.

Same operations as `cargo bench --bench allocator`, called from Python, so the crossing cost is
known. Target: one batched call that appends a token to each of 256 sequences <= 10 us.

    python benches/bench_bindings.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, time_calls, write_section  # noqa: E402

import pagedkv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    add_write_flag(ap)
    args = ap.parse_args()
    rep = 200 if args.quick else 20_000
    rows = []

    a = pagedkv.BlockAllocator(65_536, 16)

    def alloc_free_one() -> None:
        b = a.allocate(1)
        a.free(b)

    rows.append(["BlockAllocator.allocate(1) + free([b])", time_calls(alloc_free_one, repeat=rep)])
    held16 = np.arange(16, dtype=np.int64)
    a.allocate(16)

    def alloc_free_16() -> None:
        b = a.allocate(16)
        a.free(b)

    rows.append(["BlockAllocator.allocate(16) + free(list)", time_calls(alloc_free_16, repeat=rep)])

    def fork_free_16() -> None:
        a.fork(held16)
        a.free(held16)

    rows.append(["BlockAllocator.fork + free (16 ids, int64 array)", time_calls(fork_free_16, repeat=rep)])

    m = pagedkv.KVCacheManager(4096, 16)
    prompt = (np.arange(2048, dtype=np.int64) * 2654435761) % 50_000
    s, _ = m.add_sequence(prompt)
    m.allocate_slots(s, 2048)
    rows.append(
        [
            "KVCacheManager.add_sequence (2k prompt, 127 cached blocks hit) + free",
            time_calls(lambda: m.free(m.add_sequence(prompt)[0]), repeat=max(rep // 10, 100)),
        ]
    )

    # 256 sequences at 2k context; one batched decode append per call.
    steps = 1024
    num_seqs, ctx, bs = 256, 2048, 16
    mgr = pagedkv.KVCacheManager(num_seqs * ((ctx + steps) // bs + 1), bs)
    ids = []
    for i in range(num_seqs):
        seq, _ = mgr.add_sequence(np.arange(ctx, dtype=np.int64) ^ (i << 16))
        mgr.allocate_slots(seq, ctx)
        ids.append(seq)
    seq_ids = np.array(ids, dtype=np.int64)
    tokens = np.arange(num_seqs, dtype=np.int32)
    r = time_calls(lambda: mgr.append_decode_tokens(seq_ids, tokens), repeat=min(rep, steps - 8), warmup=3)
    rows.append(["KVCacheManager.append_decode_tokens, 256 seqs x 2k ctx (one call)", r])
    rows.append(
        [
            "KVCacheManager.block_tables, 256 seqs (int32[256, 193])",
            time_calls(lambda: mgr.block_tables(seq_ids), repeat=max(rep // 10, 100)),
        ]
    )

    table = md_table(
        ["operation (Python -> Rust)", "median us", "mean us", "p90 us"],
        [[name, t["median_us"], t["mean_us"], t["p90_us"]] for name, t in rows],
    )
    print(table)
    target = rows[-2][1]["median_us"]
    verdict = f"\nBatched append for 256 sequences: {target:.1f} us median (target <= 10 us: {'met' if target <= 10 else 'NOT met'})."
    print(verdict)
    if not args.no_write:
        write_section("Bindings: per-call cost (issue 2)", "python benches/bench_bindings.py", table + "\n" + verdict)


if __name__ == "__main__":
    main()
