"""A profile of one decode step: where each millisecond of ``LLMEngine.step()`` goes,
at batch 1 and batch 16, SmolLM2-135M-Instruct float32 on this machine's CPU.

The real engine (``pagedkv.LLM``) decodes ShareGPT first turns (greedy, eos ignored); once
every request is past its prompt, rounds alternate K plain steps (wall time only) and K
instrumented steps (benches/_step_probe.py: the scheduler, the step's tensors and metadata,
the forward per module kind, the LM head, the sampler, detokenizing, the rest), so the hooks'
own cost shows as instrumented minus plain. Each row is ms per step (exclusive: the parts add
up to the instrumented step).

``--linear`` adds the study of one linear call (benches/_linear_study.py): the ms per call of
the model's linears inside the step against the same calls in a tight loop, each candidate
cause alone, and the OpenMP wait policy in a child process.

    python benches/profile_step.py [--batch-sizes 1,16] [--rounds 6] [--steps 8] [--linear] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _linear_study import model_linears, run_linear_study, weight_bytes  # noqa: E402
from _results import add_write_flag, md_table, write_section  # noqa: E402
from _step_probe import FORWARD_PARTS, PARTS, StepProbe  # noqa: E402
from bench_engine import load_requests  # noqa: E402

SECTION = "profile_step"
HEADING = "## Decode step profile: where each millisecond goes (issue 29)"


def build_llm(args: argparse.Namespace, **engine_args: Any) -> Any:
    from pagedkv import LLM

    return LLM(
        None,
        dtype="float32",
        device="cpu",
        max_model_len=2048,
        max_num_seqs=max(args.batch_sizes),
        kv_cache_memory=512 << 20,
        **({"enforce_eager": True} | engine_args),  # eager unless a study asks for the compiled forward
    )


def start_decoding(engine: Any, batch: int, args: argparse.Namespace, tag: str, num_variants: int) -> list[str]:
    """Adds ``batch`` requests and steps until every one of them decodes (one token per row)."""
    from pagedkv import SamplingParams

    requests = load_requests(batch, max_prompt=args.max_prompt, max_output=2048)
    steps_needed = 2 + num_variants * args.rounds * (2 * args.steps + 1) + 8
    ids = []
    for i, (prompt, _) in enumerate(requests):
        rid = f"{tag}-{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=steps_needed, temperature=0.0, ignore_eos=True))
        ids.append(rid)
    for _ in range(64):
        before = engine._counters["tokens_computed"]
        engine.step()
        if engine._counters["tokens_computed"] - before == batch:
            break
    for _ in range(2):  # warm-up decode steps
        engine.step()
    return ids


def profile_batch(
    engine: Any, batch: int, args: argparse.Namespace, tag: str, variants: dict[str, Callable[[], None]]
) -> list[dict[str, Any]]:
    """Per variant (``variants``: name -> a call that switches the engine to it), plain and
    instrumented step times and the parts of the instrumented steps (ms/step). Every round
    runs every variant, in turn, on the same requests."""
    ids = start_decoding(engine, batch, args, tag, len(variants))
    probe = StepProbe(engine)
    plain: dict[str, list[float]] = {name: [] for name in variants}
    instrumented: dict[str, list[float]] = {name: [] for name in variants}
    # Per instrumented step, seconds per part: a part's figure is its median over the steps (a
    # shared machine's stalls hit single steps, and a mean would charge them to some part).
    per_step: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    calls: dict[str, dict[str, float]] = {name: {} for name in variants}
    for _ in range(args.rounds):
        for name, switch in variants.items():
            switch()
            engine.step()  # the first step after a switch is not counted
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                plain[name].append(time.perf_counter() - start)
            probe.install()
            probe.timers.active = True
            try:
                for _ in range(args.steps):
                    probe.timers.reset()
                    start = time.perf_counter()
                    engine.step()
                    instrumented[name].append(time.perf_counter() - start)
                    per_step[name].append(dict(probe.timers.totals))
                    for part, count in probe.timers.calls.items():
                        calls[name][part] = calls[name].get(part, 0) + count
            finally:
                probe.timers.active = False
                probe.remove()
    engine.abort_request(ids)
    runs = []
    for name in variants:
        n = len(instrumented[name])
        runs.append(
            {
                "batch": batch,
                "variant": name,
                "plain_ms": statistics.median(plain[name]) * 1e3,
                "instrumented_ms": statistics.median(instrumented[name]) * 1e3,
                "parts": {
                    part: statistics.median(step.get(part, 0.0) for step in per_step[name]) * 1e3 for part in PARTS
                },
                "calls": {part: calls[name].get(part, 0) / n for part in PARTS},
            }
        )
    return runs


def compile_ab(engine: Any, batch: int, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Plain steps eager vs compiled (``enforce_eager=False``), interleaved rounds; the first
    compiled steps' seconds (the compile: this token count's graph, after any other graph
    compiled before it in this process). With a linear kernel switched in, eager with it turned
    off (MKL) is a third variant. No instrumentation: hooks inside a compiled graph would time
    nothing real."""
    runner = engine.runner
    compiled = runner.compiled_forward
    switch = runner.linear_switch
    runner.compiled_forward = None
    ids = start_decoding(engine, batch, args, tag, 2)
    runner.compiled_forward = compiled
    start = time.perf_counter()
    engine.step()
    compile_s = time.perf_counter() - start
    names = ["eager", "compiled"] + (["eager MKL"] if switch is not None else [])
    steps: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in steps:
            runner.compiled_forward = compiled if name == "compiled" else None
            if switch is not None:
                switch.enabled = name != "eager MKL"
            engine.step()
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                steps[name].append(time.perf_counter() - start)
    runner.compiled_forward = compiled
    if switch is not None:
        switch.enabled = True
    engine.abort_request(ids)
    out = {"batch": batch, "compile_s": compile_s}
    for name, times in steps.items():
        out[name.replace(" ", "_") + "_ms"] = statistics.median(times) * 1e3
    return out


def profile_table(runs: list[dict[str, Any]]) -> str:
    headers = ["part"]
    for run in runs:
        label = f"B={run['batch']}" + (f" {run['variant']}" if run["variant"] else "")
        headers += [f"{label} ms", "%"]
    rows: list[list[object]] = []
    for name in PARTS:
        label = f"  {name}" if name in FORWARD_PARTS else name
        row: list[object] = [label]
        for run in runs:
            ms = run["parts"][name]
            row += [f"{ms:.2f}", f"{100 * ms / run['instrumented_ms']:.1f}"]
        rows.append(row)
    row = ["(forward, the indented rows)"]
    for run in runs:
        ms = sum(run["parts"][name] for name in FORWARD_PARTS)
        row += [f"{ms:.2f}", f"{100 * ms / run['instrumented_ms']:.1f}"]
    rows.append(row)
    row = ["(sum of the parts)"]
    for run in runs:
        ms = sum(run["parts"].values())
        row += [f"{ms:.2f}", f"{100 * ms / run['instrumented_ms']:.1f}"]
    rows.append(row)
    row = ["instrumented step (median)"]
    for run in runs:
        row += [f"{run['instrumented_ms']:.2f}", "100"]
    rows.append(row)
    row = ["plain step (median, same rounds)"]
    for run in runs:
        row += [f"{run['plain_ms']:.2f}", ""]
    rows.append(row)
    return md_table(headers, rows)


def linear_in_model(runs: list[dict[str, Any]], num_linears: int) -> list[list[object]]:
    """ms per linear call inside the instrumented steps (the projections and MLP linears)."""
    rows = []
    for run in runs:
        total = run["parts"]["q/k/v/o projections"] + run["parts"]["MLP linears"]
        calls = run["calls"]["q/k/v/o projections"] + run["calls"]["MLP linears"]
        if calls:
            label = f"B={run['batch']}" + (f", {run['variant']}" if run["variant"] else "")
            rows.append([f"inside the engine's step, {label} (hooks)", f"{total / calls:.3f}", "", ""])
    return rows


def compile_section(args: argparse.Namespace) -> str:
    """Eager vs compiled in a fresh engine (its own process state), with the linears of
    ``--compare-linear-kernel`` if given (then eager with MKL's linears too)."""
    print("compiled forward ...", flush=True)
    kernel = args.compare_linear_kernel
    llm = build_llm(args, enforce_eager=False, **({"linear_kernel": kernel} if kernel else {}))
    runs = [compile_ab(llm.llm_engine, batch, args, f"c{batch}") for batch in args.batch_sizes]
    linears = f"{KERNEL_NAMES[kernel]} linears" if kernel else "the default linears (MKL)"
    headers = ["batch", "eager ms/step", "compiled ms/step", "speedup", "first compiled step s"]
    if kernel:
        headers[1:1] = ["eager, MKL linears ms/step"]
        headers.insert(-1, "compiled vs eager MKL")
    rows = []
    for r in runs:
        row = [f"B={r['batch']}", f"{r['eager_ms']:.2f}", f"{r['compiled_ms']:.2f}"]
        row += [f"{r['eager_ms'] / r['compiled_ms']:.2f}x"]
        if kernel:
            row[1:1] = [f"{r['eager_MKL_ms']:.2f}"]
            row += [f"{r['eager_MKL_ms'] / r['compiled_ms']:.2f}x"]
        rows.append(row + [f"{r['compile_s']:.1f}"])
    table = md_table(headers, rows)
    print(table)
    return (
        "\nThe compiled forward (`enforce_eager=False`: torch.compile, inductor, one graph for every step size, "
        "paged attention as one custom op, freezing on the CPU with torch's linears; "
        "python/pagedkv/worker/compiled_forward.py) against eager, "
        f"both with {linears}, plain steps "
        f"interleaved ({args.rounds} rounds of {args.steps}); the first compiled step includes the "
        f"compile (later batch sizes reuse the graph).\n\n{table}\n"
    )


def wait_policy_child(rounds: int) -> dict[str, float]:
    """The tight-loop variants in a child process with ``OMP_WAIT_POLICY`` unset."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, __file__, "--linear-child", str(rounds)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def linear_child(rounds: int) -> None:
    llm = build_llm(argparse.Namespace(batch_sizes=[1]))
    print(json.dumps(run_linear_study(llm.llm_engine.runner.model, rounds)))


KERNEL_NAMES = {"onednn": "oneDNN", "pagedkv": "pagedkv kernel"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="steps per round, plain and instrumented each")
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--linear", action="store_true", help="add the study of one linear call")
    parser.add_argument(
        "--compare-linear-kernel",
        nargs="?",
        const="onednn",
        choices=["onednn", "pagedkv"],
        help="profile each batch size with the default linears (MKL) and this linear_kernel, interleaved",
    )
    parser.add_argument("--linear-rounds", type=int, default=15)
    parser.add_argument("--linear-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--compare-compile",
        action="store_true",
        help="also time plain steps eager vs enforce_eager=False (torch.compile), with the compile time",
    )
    parser.add_argument("--section", default=SECTION, help="the RESULTS.md section --write replaces")
    add_write_flag(parser)
    args = parser.parse_args()
    if args.linear_child:
        linear_child(args.linear_child)
        return
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    kernel = args.compare_linear_kernel
    llm = build_llm(args, **({"linear_kernel": kernel} if kernel else {}))
    engine = llm.llm_engine
    model = engine.runner.model
    variants: dict[str, Callable[[], None]] = {"": lambda: None}
    if kernel:
        switch = engine.runner.linear_switch

        def use(enabled: bool) -> Callable[[], None]:
            return lambda: setattr(switch, "enabled", enabled)

        variants = {"MKL (before)": use(False), f"{KERNEL_NAMES[kernel]} (after)": use(True)}
    runs = []
    for batch in args.batch_sizes:
        for run in profile_batch(engine, batch, args, f"b{batch}", variants):
            runs.append(run)
            print(
                f"B={batch} {run['variant']}: plain {run['plain_ms']:.1f} ms/step, "
                f"instrumented {run['instrumented_ms']:.1f}",
                flush=True,
            )
    next(iter(variants.values()))()  # back to the first variant (the linear study calls modules)
    table = profile_table(runs)
    print(table)

    num_linears = len(model_linears(model))
    mb = weight_bytes(model) / 1e6
    head = model.get_output_embeddings().weight
    head_mb = head.numel() * head.element_size() / 1e6
    body = (
        f"SmolLM2-135M-Instruct float32 ({mb:.0f} MB of decoder linears + {head_mb:.0f} MB LM head read per "
        f"decode step), CPU attention backend, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}. ShareGPT first turns (prompt <= {args.max_prompt} "
        f"tokens), greedy, eos ignored, all requests decoding; {args.rounds} rounds of {args.steps} plain + "
        f"{args.steps} instrumented steps per batch size. Each part: its median ms over the instrumented steps, "
        f"exclusive (a part's time excludes the timed parts it calls; % of the median instrumented step); "
        f"the indented rows are the forward.\n\n{table}\n"
    )
    if args.linear:
        print("linear study ...", flush=True)
        study = run_linear_study(model, args.linear_rounds)
        child = wait_policy_child(args.linear_rounds)
        rows = linear_in_model(runs, num_linears)
        base = study["layer order (as the model calls)"]
        for name, ms in study.items():
            rows.append([f"tight loop: {name}", f"{ms:.3f}", f"{ms / base:.2f}x", f"{mb / num_linears / ms:.1f}"])
        base_child = child["layer order (as the model calls)"]
        rows.append(
            [
                "tight loop: layer order, OMP_WAIT_POLICY unset (child process)",
                f"{base_child:.3f}",
                f"{base_child / base:.2f}x",
                f"{mb / num_linears / base_child:.1f}",
            ]
        )
        linear_table = md_table(["linear calls (the model's own weights)", "ms / call", "vs layer order", "GB/s"], rows)
        print(linear_table)
        body += (
            f"\nOne linear call: the {num_linears} decoder linears of a batch-1 step ({mb:.0f} MB), median of "
            f"{args.linear_rounds} interleaved rounds per variant (benches/_linear_study.py).\n\n{linear_table}\n"
        )
    if args.compare_compile:
        body += compile_section(args)
    if not args.no_write:
        command = "python benches/profile_step.py " + " ".join(sys.argv[1:])
        write_section(args.section, command.strip(), body, HEADING)


if __name__ == "__main__":
    main()
