"""The work of a decode step outside its linears, eager against compiled.

A batch-1 SmolLM2 step reads 538 MB of weights; at the rate pagedkv's CPU linear kernel streams
them that is ~28 ms, so what a step spends beyond the linears (norms, RoPE, attention, the
ops' dispatch, the step's Python) decides how close it gets to llama.cpp's server. This
benchmark measures that part directly: in one engine (``linear_kernel="pagedkv"``,
``enforce_eager=False``) decoding ``B`` ShareGPT first turns, interleaved rounds run plain
steps in four variants:

* eager or compiled (the runner's compiled forward switched off and on, as
  ``profile_step.py --compare-compile`` does);
* the kernel's products as shipped, without its prefetch of weight rows ahead
  (``prefetch=False``: the kernel before it had one; same bits), or replaced by a call that
  returns at once (its output left uninitialised: the tokens are garbage, the step's work
  otherwise the same).

"outside the linears" = the stubbed step; "the linears" = the step minus the stubbed step.
Medians over the rounds, ms per step. A second table times the kernel alone: one pass over
the model's 211 linears at one and 16 rows, prefetch on and off, against ``torch.sum`` over the
same number of bytes (the machine's read bandwidth), interleaved rounds.

    python benches/bench_step_overhead.py [--batch-sizes 1,16] [--rounds 8] [--steps 6] [--write]
"""

from __future__ import annotations

import argparse
import functools
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
LINEARS = ("kernel", "no prefetch", "stubbed")
VARIANTS = [(mode, linears) for mode in ("eager", "compiled") for linears in LINEARS]


def measure(engine: Any, batch: int, args: argparse.Namespace) -> dict[tuple[str, str], float]:
    from pagedkv.worker import cpu_linear

    runner = engine.runner
    compiled = runner.compiled_forward
    real_core = cpu_linear._core
    cores = {
        "kernel": real_core,
        "no prefetch": SimpleNamespace(cpu_linear=functools.partial(real_core.cpu_linear, prefetch=False)),
        "stubbed": SimpleNamespace(cpu_linear=lambda *a, **k: None),
    }
    probe = argparse.Namespace(max_prompt=args.max_prompt, rounds=args.rounds, steps=args.steps)
    ids = start_decoding(engine, batch, probe, f"b{batch}", len(VARIANTS))
    engine.step()  # the compiled graph's first call (a compile when the disk cache is cold)
    times: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    try:
        for _ in range(args.rounds):
            for mode, linears in VARIANTS:
                runner.compiled_forward = compiled if mode == "compiled" else None
                cpu_linear._core = cores[linears]
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


def kernel_alone(model: Any, rounds: int) -> str:
    """The kernel in a tight loop over the model's linears (float32 weights, layer order), prefetch on
    and off, and ``torch.sum`` over as many bytes; medians of interleaved rounds, ms per pass."""
    import numpy as np
    import torch

    from pagedkv import _core

    weights = [m.weight.detach().numpy() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    total = sum(w.nbytes for w in weights)
    flat = torch.ones(total // 4)
    threads = torch.get_num_threads()
    rows = []
    for m in (1, 16):
        inputs = {w.shape[1]: np.ones((m, w.shape[1]), np.float32) for w in weights}
        outs = [np.empty((m, w.shape[0]), np.float32) for w in weights]

        def one_pass(inputs: dict[int, Any], outs: list[Any], prefetch: bool) -> None:
            for w, out in zip(weights, outs):
                _core.cpu_linear(inputs[w.shape[1]], w, out, threads, prefetch=prefetch)

        runs: dict[str, Any] = {
            "prefetch": functools.partial(one_pass, inputs, outs, True),
            "no prefetch": functools.partial(one_pass, inputs, outs, False),
        }
        if m == 1:
            runs["torch.sum, same bytes"] = lambda: flat.sum()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                run()
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        for name, t in times.items():
            med = statistics.median(t)
            rows.append([f"M={m}", name, f"{med * 1e3:.2f}", f"{total / med / 1e9:.1f}"])
    return (
        f"The kernel alone: one pass over the model's {len(weights)} linears ({total / 1e6:.0f} MB of float32 "
        f"weights, layer order) on {threads} threads, medians of {rounds} interleaved rounds.\n\n"
        + md_table(["rows", "kernel", "ms per pass", "GB/s"], rows)
    )


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
            step, bare, outside = (ms[(mode, lin)] for lin in LINEARS)
            rows.append(
                [
                    f"B={batch}",
                    mode,
                    f"{step:.2f}",
                    f"{bare:.2f}",
                    f"{outside:.2f}",
                    f"{step - outside:.2f}",
                    f"{bare - outside:.2f}",
                ]
            )
        speedup = ms[("eager", "kernel")] / ms[("compiled", "kernel")]
        outside = ms[("eager", "stubbed")] / ms[("compiled", "stubbed")]
        print(f"B={batch}: compiled {speedup:.2f}x eager; outside the linears {outside:.2f}x", flush=True)
        rows.append([f"B={batch}", "eager / compiled", f"{speedup:.2f}x", "", f"{outside:.2f}x", "", ""])
    table = md_table(
        [
            "batch",
            "forward",
            "step ms",
            "step ms, no prefetch",
            "outside the linears ms",
            "the linears ms",
            "the linears ms, no prefetch",
        ],
        rows,
    )
    kernel_table = kernel_alone(llm.llm_engine.runner.model, args.rounds)
    import torch

    body = (
        f'SmolLM2-135M-Instruct float32, `linear_kernel="pagedkv"`, CPU, torch {torch.__version__}, '
        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY=PASSIVE; ShareGPT first turns (prompt <= "
        f"{args.max_prompt} tokens) decoding, greedy; {args.rounds} interleaved rounds of {args.steps} plain steps "
        f'per variant, medians. "outside the linears": the same step with every product of pagedkv\'s kernel '
        f"stubbed out.\n\n{table}\n\n{kernel_table}\n"
    )
    print(table)
    print(kernel_table)
    if not args.no_write:
        write_section(SECTION, "python benches/bench_step_overhead.py --write", body, HEADING)


if __name__ == "__main__":
    main()
