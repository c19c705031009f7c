"""A model without KV cache groups costs what it cost before groups existed: the
engine's output tokens/s on SmolLM2-135M (every layer full attention: one KV cache group), this
checkout against another build of pagedkv, side by side.

The other build is a pagedkv source tree whose extension is built in place
(``python/pagedkv/_core.abi3.so``), e.g. the commit before KV cache groups::

    git worktree add /tmp/before ddacf90
    (cd /tmp/before && cargo build --release --features python && \\
        cp target/release/libpagedkv.so python/pagedkv/_core.abi3.so)
    python benches/bench_one_column.py --other /tmp/before [--write]

Each run is a fresh process (``PYTHONPATH`` picks the tree) that serves the same ShareGPT first
turns (greedy, ``ignore_eos``, outputs capped) through ``LLM.generate``; the two builds
alternate (this, other, other, this, ...) so that a machine that gets busier or quieter weighs
on both alike. Printed: each build's output tok/s per round, the medians and their ratio
(target: this / other >= 0.97), the same for the process's CPU time per output token (all
threads: less sensitive than wall time to a shared machine's other tenants), and whether the
greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
THIS_TREE = HERE.parent / "python"
sys.path.insert(0, str(HERE))
from _results import add_write_flag, write_section  # noqa: E402

TARGET = 0.97
# One run, in the child process: the workload and its figures as one JSON line.
_CHILD = r"""
import json, sys, time
from pagedkv import LLM, SamplingParams
from pagedkv.sim.workloads import sharegpt_first_turn_requests
n, max_output = int(sys.argv[1]), int(sys.argv[2])
reqs = sharegpt_first_turn_requests(n * 3, max_prompt_len=512, max_model_len=2048)[:n]
llm = LLM(None, dtype="float32", device="cpu", max_model_len=2048, kv_cache_memory=512 << 20)
prompts = [{"prompt_token_ids": r.prompt_token_ids.tolist()} for r in reqs]
params = [SamplingParams(max_tokens=min(r.output_len, max_output), temperature=0.0, ignore_eos=True) for r in reqs]
llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
started, cpu_started = time.perf_counter(), time.process_time()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
tokens = [list(o.outputs[0].token_ids) for o in outs]
n_out = sum(map(len, tokens))
print(json.dumps({"tok_s": n_out / elapsed, "seconds": elapsed, "cpu_ms_per_token": 1e3 * cpu / n_out, "tokens": tokens}))
"""


def run(tree: Path, n: int, max_output: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(n), str(max_output)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def git_rev(tree: Path) -> str:
    rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return rev.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="the other pagedkv source tree (built in place)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (each runs both builds once)")
    add_write_flag(parser)
    args = parser.parse_args()
    other = args.other.resolve() / "python"
    builds = {"this": THIS_TREE, "other": other}
    runs: dict[str, list[dict]] = {"this": [], "other": []}
    load_before = os.getloadavg()[0]
    for k in range(args.rounds):
        for name in ("this", "other") if k % 2 == 0 else ("other", "this"):
            r = run(builds[name], args.requests, args.max_output)
            runs[name].append(r)
            print(
                f"round {k + 1} {name}: {r['tok_s']:.1f} output tok/s ({r['seconds']:.1f} s), "
                f"{r['cpu_ms_per_token']:.1f} CPU ms per token",
                flush=True,
            )
    load_after = os.getloadavg()[0]
    median = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in runs.items()}
    cpu = {name: statistics.median(r["cpu_ms_per_token"] for r in rs) for name, rs in runs.items()}
    ratio = median["this"] / median["other"]
    cpu_ratio = cpu["other"] / cpu["this"]
    same = all(r["tokens"] == runs["other"][0]["tokens"] for rs in runs.values() for r in rs)
    lines = [
        f"SmolLM2-135M (embedded, float32, one KV cache group) on the CPU: {args.requests} ShareGPT first turns "
        f"(prompt <= 512 tokens, outputs capped at {args.max_output}, greedy, ignore_eos) through `LLM.generate`, "
        f"one fresh process per run, {args.rounds} alternating rounds; load average {load_before:.2f} before, "
        f"{load_after:.2f} after (2 CPUs).",
        "",
        "| build | commit | output tok/s per round | median | CPU ms per output token per round | median |",
        "|---|---|---|---|---|---|",
    ]
    for name, tree in builds.items():
        per_round = ", ".join(f"{r['tok_s']:.1f}" for r in runs[name])
        cpu_rounds = ", ".join(f"{r['cpu_ms_per_token']:.1f}" for r in runs[name])
        lines.append(
            f"| {name} | {git_rev(tree.parent)} | {per_round} | {median[name]:.1f} | {cpu_rounds} | {cpu[name]:.1f} |"
        )
    lines += [
        "",
        f"Throughput this / other: **{ratio:.3f}** by wall time, **{cpu_ratio:.3f}** by CPU time per token "
        f"(target >= {TARGET}: {'met' if min(ratio, cpu_ratio) >= TARGET else 'NOT met' if max(ratio, cpu_ratio) < TARGET else 'met by one measure only'}); "
        f"greedy tokens {'identical' if same else 'DIFFER'}.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(
            "one-column-engine",
            f"python benches/bench_one_column.py --other <tree at {git_rev(other.parent)}> --write",
            body,
            heading="## KV cache groups: engine throughput of a model with one column (issue 25)",
        )


if __name__ == "__main__":
    main()
