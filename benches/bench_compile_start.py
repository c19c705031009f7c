"""What ``enforce_eager=False`` costs at start: the compile on a first start, and on a
second start that finds the first one's caches on disk.

Each run is a fresh process (SmolLM2-135M-Instruct, float32, CPU) that builds ``LLM(...)`` and
answers one 4-token request; its time from the start of ``LLM(...)`` to the answer is the
*start*. The compiled variants start twice on one empty cache folder (``TORCHINDUCTOR_CACHE_DIR``,
a temporary folder: the first start is cold, the second finds what the first wrote); the eager
engine with the same linears starts once, and *extra* is a compiled start minus it. The
process also reports dynamo's graph count, how its forward was made (compiled and saved, or
loaded from the saved file: pagedkv.worker.compiled_artifact), inductor's and AOT autograd's
cache hits, and the time of a second request after the first (a step of the compiled graph, no
compile).

Linears: torch's (``linear_kernel="torch"``: the runner compiles with inductor's freezing,
whose graphs AOT autograd does not cache), pagedkv's kernel (``"pagedkv"``) and int8 weights
(``quantization="int8"``).

    python benches/bench_compile_start.py            # print the table
    python benches/bench_compile_start.py --write    # and record it in benches/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402

# The child: one engine, one request, its figures as a JSON line on stdout.
_CHILD = r"""
import json, sys, time
start = time.perf_counter()
from pagedkv import LLM, SamplingParams
from pagedkv.worker.model_files import default_model_dir
imported = time.perf_counter()
engine_args = json.loads(sys.argv[1])
llm = LLM(model=str(default_model_dir()), dtype="float32", device="cpu", max_model_len=1024, **engine_args)
built = time.perf_counter()
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
llm.generate(["The capital of France is"], params, use_tqdm=False)
answered = time.perf_counter()
llm.generate(["Water boils at a temperature of", "1, 2, 3,"], params, use_tqdm=False)
again = time.perf_counter()
from torch._dynamo.utils import counters
compiled = llm.llm_engine.runner.compiled_forward
print(json.dumps({
    "origin": compiled.origin if compiled is not None else None,
    "import_s": imported - start,
    "build_s": built - imported,
    "first_request_s": answered - built,
    "start_s": answered - imported,
    "second_request_s": again - answered,
    "graphs": counters["stats"]["unique_graphs"],
    "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
    "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
    "aot_bypass": counters["aot_autograd"]["autograd_cache_bypass"],
}))
"""

VARIANTS = [
    ("torch's linears (frozen)", {"linear_kernel": "torch"}),
    ("pagedkv kernel", {"linear_kernel": "pagedkv"}),
    ("int8 weights", {"quantization": "int8"}),
]


def start(engine_args: dict, cache_dir: str) -> dict:
    # Python keeps the bytecode it compiles, as on a machine where pip installed torch (pip
    # byte-compiles at install; uv and this project's Makefile leave it to the first import).
    # Under PYTHONDONTWRITEBYTECODE (this project's machines set it) every start compiled
    # dynamo's and inductor's ~1,000 modules from source again, ~8 s that a compiled start paid
    # and an eager one did not.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(engine_args)], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"the engine with {engine_args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_write_flag(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-inductor-") as cache:
        start({"enforce_eager": True}, cache)  # untimed: writes the bytecode every start imports
    for name, extra in VARIANTS:
        with tempfile.TemporaryDirectory(prefix="pagedkv-inductor-") as cache:
            eager = start({**extra, "enforce_eager": True}, cache)
            cold = start({**extra, "enforce_eager": False}, cache)
            warm = start({**extra, "enforce_eager": False}, cache)
        print(
            f"{name}: eager {eager['start_s']:.1f} s, cold {cold['start_s']:.1f} s, warm {warm['start_s']:.1f} s",
            flush=True,
        )
        for label, run in (("eager", eager), ("compiled, first start", cold), ("compiled, second start", warm)):
            extra_s = "" if label == "eager" else f"{run['start_s'] - eager['start_s']:+.1f}"
            caches = (
                "" if label == "eager" else f"FX {run['fx_hits']}, AOT {run['aot_hits']} (bypassed {run['aot_bypass']})"
            )
            rows.append(
                [
                    name,
                    label,
                    f"{run['build_s']:.1f}",
                    f"{run['first_request_s']:.1f}",
                    f"{run['start_s']:.1f}",
                    extra_s,
                    "" if label == "eager" else run["graphs"],
                    run["origin"] or "",
                    caches,
                    f"{1000 * run['second_request_s']:.0f}",
                ]
            )
    table = md_table(
        [
            "linears",
            "run",
            "LLM(...) s",
            "first request s",
            "start s",
            "extra vs eager s",
            "graphs",
            "forward",
            "cache hits",
            "second request ms",
        ],
        rows,
    )
    body = "\n".join(
        [
            "SmolLM2-135M-Instruct, float32, CPU; each row a fresh process: `LLM(...)` then one 4-token "
            "request (start = both), then a 2-request batch of 4 tokens (second request); compiled starts "
            "share one empty `TORCHINDUCTOR_CACHE_DIR`, the first cold, the second warm; forward: "
            "captured (compiled whole and saved), loaded (the saved forward) or jit (torch.compile as "
            "called: a frozen graph, not saved); Python's bytecode kept (an untimed eager start first).",
            "",
            table,
            "",
            f"Total {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at the end "
            f"({os.cpu_count()} CPUs).",
        ]
    )
    print(body)
    if not args.no_write:
        write_section(
            "compile-start",
            "python benches/bench_compile_start.py --write",
            body,
            heading="## Compiled forward: compile time at start, cold and warm caches (issue 29)",
        )


if __name__ == "__main__":
    main()
