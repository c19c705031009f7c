"""The attack suite's benchmark mode: an honest client's latency under each attack of
tests/adversarial against its latency at rest (target: within 2x).

    python benches/bench_attacks.py                 # 5 honest requests per attack and at rest
    python benches/bench_attacks.py --rounds 9 -k grammar --write

Runs ``pytest tests/adversarial`` in one process (no xdist: nothing else competes for the
cores) with ``PAGEDKV_ATTACK_BENCH=N``: every attack is the same as in ``make test`` (the
same checks: the honest text unchanged, ``/health``, no block lost), with ``N`` honest
requests beside it instead of one, and ``N`` at rest when each module's harness starts. Each
ratio is the median latency under the attack over the median at rest, on that module's own
server. With ``--write`` the table goes to benches/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET = 2.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="honest requests per attack and at rest")
    parser.add_argument("-k", dest="keyword", default=None, help="only the attacks pytest -k selects")
    add_write_flag(parser)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pagedkv-attack-bench-") as tmp:
        out = Path(tmp) / "reports.jsonl"
        env = {
            **os.environ,
            "PAGEDKV_ATTACK_BENCH": str(args.rounds),
            "PAGEDKV_ATTACK_BENCH_OUT": str(out),
            "OMP_WAIT_POLICY": "PASSIVE",
        }
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "tests/adversarial"]
        cmd += ["--ignore", "tests/adversarial/test_attack_harness.py"]  # the harness's own checks, no attack
        if args.keyword:
            cmd += ["-k", args.keyword]
        done = subprocess.run(cmd, cwd=ROOT, env=env)
        reports = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if done.returncode != 0:
        print(f"the attack suite failed (exit {done.returncode}); figures of the attacks that ran follow")
    rows = [
        [
            r["attack"],
            r["rounds"],
            f"{r['quiet_median_s'] * 1000:.0f}",
            f"{r['honest_median_s'] * 1000:.0f}",
            f"{r['ratio']:.2f}x",
            "yes" if r["ratio"] <= TARGET else "**no**",
        ]
        for r in reports
    ]
    table = md_table(
        ["attack", "honest requests", "at rest (ms, median)", "under attack (ms, median)", "ratio", f"<= {TARGET}x"],
        rows,
    )
    print(table)
    if not args.no_write and rows:
        command = "python benches/bench_attacks.py " + " ".join(sys.argv[1:])
        body = (
            "An honest greedy completion (8 tokens) sent while each attack of `tests/adversarial` is in "
            "flight, against the same request at rest on the same server (medians; each module "
            "starts its own server). Every row also passed the suite's checks: the honest text "
            "unchanged, `/health` truthful, no block lost.\n\n" + table
        )
        write_section(
            "attack suite", command.strip(), body, heading="## Attack suite: an honest client under attack (issue 48)"
        )
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
