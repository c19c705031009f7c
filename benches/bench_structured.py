"""Structured outputs: what a JSON schema per row costs a decode step (issue 27).

One engine (SmolLM2, float32, CPU) decodes ``B`` requests at a time (chat prompts asking for a
JSON record, greedy), in interleaved rounds of two variants on the same prompts:

* ``unconstrained``: plain requests (``ignore_eos``);
* ``schema``: each request with one JSON schema of tests/data/json_schemas.json (cycled), so every
  row's logits get a grammar mask, filled by llguidance beside the forward.

A round adds the ``B`` requests, runs their prefill, then times the next ``--steps`` decode steps
while all ``B`` rows are still running (a schema row that completes its JSON early would leave the
batch: such rounds are timed up to that step), and aborts the rest. Grammars are compiled before
the first round (the compile cache then serves them: compile time is not step time). The figure
is the median step time per variant and their ratio; the engine's own mask-fill histogram gives
the masks' mean fill time per step.

    python benches/bench_structured.py [--batch 64] [--rounds 4] [--steps 8] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402

SECTION = "structured_step_cost"
HEADING = "## Structured outputs: a decode step with a JSON schema per row (issue 27)"
CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas.json"


def requests(engine: Any, batch: int, constrained: bool) -> list[tuple[str, Any]]:
    from pagedkv import SamplingParams

    schemas = list(json.loads(CORPUS.read_text())["schemas"].values())
    out = []
    for i in range(batch):
        schema = schemas[i % len(schemas)]
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Reply with a JSON record for item {i}."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        params = SamplingParams(
            temperature=0.0,
            max_tokens=512,
            ignore_eos=not constrained,
            structured_outputs={"json": schema} if constrained else None,
        )
        out.append((prompt, params))
    return out


def one_round(engine: Any, batch: int, steps: int, constrained: bool, tag: str) -> list[float]:
    """Step times (s) of up to ``steps`` decode steps with all ``batch`` rows running."""
    ids = []
    for i, (prompt, params) in enumerate(requests(engine, batch, constrained)):
        rid = f"{tag}-{i}"
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    while engine.get_stats()["num_running"] < batch or engine.scheduler.stats().num_waiting:
        engine.step()  # prefill (chunked) until every row decodes
    times = []
    for _ in range(steps):
        if engine.get_num_unfinished_requests() < batch:
            break
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        if any(o.finished for o in outputs):
            break
    live = [rid for rid in ids if rid in engine.requests]
    if live:
        engine.abort_request(live)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    add_write_flag(parser)
    args = parser.parse_args()

    from pagedkv import LLMEngine

    engine = LLMEngine(
        dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=512 << 20, max_num_seqs=args.batch,
        max_num_batched_tokens=4096, enable_prefix_caching=False,
    )  # fmt: skip
    schemas = json.loads(CORPUS.read_text())["schemas"].values()
    from pagedkv.structured import StructuredOutputsParams

    engine.compile_grammars(StructuredOutputsParams(json=s) for s in schemas)
    one_round(engine, args.batch, 2, True, "warm-s")
    one_round(engine, args.batch, 2, False, "warm-u")
    fills_before = engine.get_stats()["structured_mask_seconds"]
    times: dict[str, list[float]] = {"unconstrained": [], "schema": []}
    for r in range(args.rounds):
        for name in ("unconstrained", "schema") if r % 2 == 0 else ("schema", "unconstrained"):
            times[name] += one_round(engine, args.batch, args.steps, name == "schema", f"{name}-{r}")
    fills = engine.get_stats()["structured_mask_seconds"]
    fill_count = fills["count"] - fills_before["count"]
    fill_mean_ms = 1e3 * (fills["sum"] - fills_before["sum"]) / max(1, fill_count)
    plain = statistics.median(times["unconstrained"])
    schema = statistics.median(times["schema"])
    rows = [
        ["unconstrained", len(times["unconstrained"]), 1e3 * plain, "-"],
        ["JSON schema per row", len(times["schema"]), 1e3 * schema, f"{fill_mean_ms:.2f} ms per step"],
    ]
    body = md_table(["rows", "steps timed", "median step (ms)", "mask fill (beside the forward)"], rows)
    body += f"\n\nBatch {args.batch}, greedy; schema / unconstrained step time: **{schema / plain:.3f}x** (target <= 1.15x)."
    print(body)
    if not args.no_write:
        command = f"python benches/bench_structured.py --batch {args.batch} --rounds {args.rounds} --steps {args.steps} --write"
        write_section(SECTION, command, body, HEADING)


if __name__ == "__main__":
    main()
