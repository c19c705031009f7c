"""A change's cost on the step path: two checkouts measured alternately, side by side.

Each round runs, in fresh processes and in alternating order, the scheduler's step from Python
(``bench_scheduler.decode_steps`` / ``mixed_steps``: schedule + update with the numpy outputs)
and the engine's offline throughput (``bench_engine.run_pagedkv`` on ShareGPT first turns, the
embedded SmolLM2 on the CPU, greedy, eager so that the engine's own Python work is not hidden
behind a compiled forward), each checkout with its own benchmark code and its own built
extension. Alternating rounds spread a busy machine's drift over both sides; the ratio of the
medians is the figure (>= 1: the second checkout is no slower).

    git worktree add --detach ../before <rev>        # then build it, or copy a matching _core
    python benches/bench_before_after.py --before ../before [--after .] [--rounds 5] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402

# Run inside the checkout under test: its python/ and benches/ first on the path.
_PROBE = """
import json, sys
tree, kind, num_requests = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path[:0] = [tree + "/python", tree + "/benches"]
import pagedkv
assert pagedkv.__file__.startswith(tree), pagedkv.__file__
if kind == "scheduler":
    import bench_scheduler as b
    result = {"decode_us": b.decode_steps(256, 2048, 1000)["median_us"], "mixed_us": b.mixed_steps(1000)["median_us"]}
else:
    import bench_engine as e
    run = e.run_pagedkv(e.load_requests(num_requests, 512, 128), kv_cache_memory="512MiB")
    result = {"tok_s": run["tokens"] / run["seconds"]}
print("RESULT " + json.dumps(result))
"""


def _run(tree: Path, kind: str, num_requests: int) -> dict[str, float]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PAGEDKV_ENFORCE_EAGER="1")
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tree), kind, str(num_requests)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} in {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _head(tree: Path) -> str:
    """The checkout's commit, for the record."""
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the checkout to compare against (built)")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1], help="this checkout")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=32, help="ShareGPT requests per engine run")
    ap.add_argument("--label", default="", help="what changed (the RESULTS section's title)")
    add_write_flag(ap)
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, dict[str, list[float]]] = {side: {} for side in trees}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for kind in ("scheduler", "engine"):
            for side in order:
                for key, value in _run(trees[side], kind, args.requests).items():
                    runs[side].setdefault(key, []).append(value)
        print(f"round {r + 1}/{args.rounds}: " + json.dumps(runs), flush=True)
    rows = []
    for key, name, higher_is_better in (
        ("decode_us", "scheduler step from Python: 256 decodes, 2k contexts (median us)", False),
        ("mixed_us", "scheduler step from Python: mixed decodes + prompt chunks (median us)", False),
        ("tok_s", f"engine: {args.requests} ShareGPT requests, SmolLM2, CPU, eager (tok/s)", True),
    ):
        before, after = statistics.median(runs["before"][key]), statistics.median(runs["after"][key])
        speed = after / before if higher_is_better else before / after
        rows.append([name, before, after, f"{speed:.3f}", " / ".join(f"{v:.1f}" for v in runs["after"][key])])
    table = md_table(["measure", "before (median)", "after (median)", "speed after/before", "after's rounds"], rows)
    print(table)
    if not args.no_write:
        write_section(
            f"Before and after: {args.label or trees['after'].name}",
            f"python benches/bench_before_after.py --before {args.before} --rounds {args.rounds} --requests {args.requests}",
            f"{args.rounds} rounds, sides alternating, fresh processes; before: {_head(trees['before'])}.\n\n{table}",
        )


if __name__ == "__main__":
    main()
