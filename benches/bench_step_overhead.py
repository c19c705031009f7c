"""The work of a decode step outside its linears, eager against compiled (issue 29).

A batch-1 SmolLM2 step reads 538 MB of weights; at the rate pagedkv's CPU linear kernel streams
them that is ~28 ms, so what a step spends beyond the linears (norms, RoPE, attention, the
ops' dispatch, the step's Python) decides how close it gets to llama.cpp's server. This
benchmark measures that part directly: in one engine (``linear_kernel="pagedkv"``,
``enforce_eager=False``) decoding ``B`` ShareGPT first turns, interleaved rounds run plain
steps in four variants:

* eager or compiled (the runner's compiled forward switched off and on, as
  ``profile_step.py --compare-compile`` does);
* the real linears, or every product of the kernel replaced by a call that returns at once
  (its output left uninitialised: the tokens are garbage, the step's work otherwise the same).

"outside the linears" = the stubbed step; "the linears" = real minus stubbed. Medians over
the rounds, ms per step.

    python benches/bench_step_overhead.py [--batch-sizes 1,16] [--rounds 8] [--steps 6] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402
from profile_step import build_llm, start_decoding  # noqa: E402

SECTION = "step_overhead"
HEADING = "## Compiled forward: the step's overhead (issue 29)"
VARIANTS = [(mode, linears) for mode in ("eager", "compiled") for linears in ("real", "stubbed")]


def measure(engine: Any, batch: int, args: argparse.Namespace) -> dict[tuple[str, str], float]:
    from pagedkv.worker import cpu_linear

    runner = engine.runner
    compiled = runner.compiled_forward
    real_core = cpu_linear._core
    stub_core = SimpleNamespace(cpu_linear=lambda *a, **k: None)
    probe = argparse.Namespace(max_prompt=args.max_prompt, rounds=args.rounds, steps=args.steps)
    ids = start_decoding(engine, batch, probe, f"b{batch}", len(VARIANTS))
    engine.step()  # the compiled graph's first call (a compile when the disk cache is cold)
    times: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    try:
        for _ in range(args.rounds):
            for mode, linears in VARIANTS:
                runner.compiled_forward = compiled if mode == "compiled" else None
                cpu_linear._core = real_core if linears == "real" else stub_core
                engine.step()  # the first step after a switch is not counted
                for _ in range(args.steps):
                    start = time.perf_counter()
                    engine.step()
                    times[(mode, linears)].append(time.perf_counter() - start)
    finally:
        runner.compiled_forward = compiled
        cpu_linear._core = real_core
    engine.abort_request(ids)
    return {v: statistics.median(t) * 1e3 for v, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-prompt", type=int, default=256)
    add_write_flag(parser)
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    llm = build_llm(args, enforce_eager=False, linear_kernel="pagedkv")
    rows = []
    for batch in args.batch_sizes:
        ms = measure(llm.llm_engine, batch, args)
        for mode in ("eager", "compiled"):
            real, stubbed = ms[(mode, "real")], ms[(mode, "stubbed")]
            rows.append([f"B={batch}", mode, f"{real:.2f}", f"{stubbed:.2f}", f"{real - stubbed:.2f}"])
        speedup = ms[("eager", "real")] / ms[("compiled", "real")]
        outside = ms[("eager", "stubbed")] / ms[("compiled", "stubbed")]
        print(f"B={batch}: compiled {speedup:.2f}x eager; outside the linears {outside:.2f}x", flush=True)
        rows.append([f"B={batch}", "compiled / eager", f"{speedup:.2f}x faster", f"{outside:.2f}x faster", ""])
    table = md_table(["batch", "forward", "step ms", "outside the linears ms", "the linears ms"], rows)
    import torch

    body = (
        f'SmolLM2-135M-Instruct float32, `linear_kernel="pagedkv"`, CPU, torch {torch.__version__}, '
        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY=PASSIVE; ShareGPT first turns (prompt <= "
        f"{args.max_prompt} tokens) decoding, greedy; {args.rounds} interleaved rounds of {args.steps} plain steps "
        f'per variant, medians. "outside the linears": the same step with every product of pagedkv\'s kernel '
        f"stubbed out.\n\n{table}\n"
    )
    print(table)
    if not args.no_write:
        write_section(SECTION, "python benches/bench_step_overhead.py --write", body, HEADING)


if __name__ == "__main__":
    main()
