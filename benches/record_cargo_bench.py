"""Runs the criterion benches (`cargo bench`) and records their figures in benches/RESULTS.md.

    python benches/record_cargo_bench.py [--bench allocator|scheduler]

Targets: <= 20 ns per single-block allocate+free; <= 5 us to append one token to each
of 256 sequences. The scheduler step for 256 decodes is reported next to the Python
figure of benches/bench_scheduler.py. The n-gram proposer for 256 rows <= 50 us per step.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import md_table, write_section  # noqa: E402

# "name\n    time:   [low mid high]" as criterion prints it.
_RESULT = re.compile(r"^(\S.*?)\s*\n\s+time:\s+\[(\S+) (\S+) (\S+) (\S+) (\S+) (\S+)\]", re.M)
_UNITS = {"ps": 1e-3, "ns": 1.0, "µs": 1e3, "us": 1e3, "ms": 1e6, "s": 1e9}


def to_ns(value: str, unit: str) -> float:
    return float(value) * _UNITS[unit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bench", action="append", choices=["allocator", "scheduler"], help="default: both")
    args = ap.parse_args()
    benches = args.bench or ["allocator", "scheduler"]
    root = Path(__file__).resolve().parent.parent
    for bench in benches:
        proc = subprocess.run(
            ["cargo", "bench", "--bench", bench], cwd=root, capture_output=True, text=True, check=True
        )
        rows = []
        for m in _RESULT.finditer(proc.stdout):
            name = m.group(1).strip()
            mid = to_ns(m.group(4), m.group(5))
            low, high = to_ns(m.group(2), m.group(3)), to_ns(m.group(6), m.group(7))
            rows.append([name, mid, low, high])
        if not rows:
            sys.exit(f"no criterion results found in the output of cargo bench --bench {bench}")
        table = md_table(["benchmark", "time (ns, criterion estimate)", "low", "high"], rows)
        print(table)
        notes = ""
        if bench == "allocator":
            single = next(r[1] for r in rows if "1 block" in r[0])
            append = next(r[1] for r in rows if "256 sequences" in r[0])
            notes = (
                f"\nSingle-block allocate+free: {single:.1f} ns (target <= 20 ns: {'met' if single <= 20 else 'NOT met'}). "
                f"One token appended to each of 256 sequences: {append / 1000:.2f} us "
                f"(target <= 5 us: {'met' if append <= 5000 else 'NOT met'}), block allocation included at its "
                f"steady-state rate (every 16th step). Blocks filled by decoding are hashed into the prefix cache "
                f"when their sequence is freed (prompt blocks: when scheduled), so that cost is in `free`, not here."
            )
        if bench == "scheduler":
            for label, prefix in (("n-gram", "ngram proposals"), ("suffix", "suffix proposals")):
                cost = next((r[1] for r in rows if r[0].startswith(prefix)), None)
                if cost is not None:
                    notes += (
                        f"\n{label} proposer, 256 rows with 2k-token contexts: {cost / 1000:.1f} us per step "
                        f"(target <= 50 us: {'met' if cost <= 50_000 else 'NOT met'})."
                    )
        write_section(
            f"cargo bench --bench {bench}",
            f"python benches/record_cargo_bench.py --bench {bench}",
            table + "\n" + notes,
        )


if __name__ == "__main__":
    main()
