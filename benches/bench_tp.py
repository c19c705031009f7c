"""Tensor parallelism on this CPU: step time, the share spent in collectives, and the step
broadcast against the scheduler's own step cost.

For each tensor_parallel_size (default: 1 and 3 for the embedded SmolLM2-135M, whose 9 heads
and 3 KV heads divide by 3 but not 2), one engine (``device="cpu"``, float32, ``mp``
workers) runs the same ShareGPT first turns (``--num-requests``, output capped at
``--max-tokens``, greedy, ``ignore_eos``) through ``LLMEngine.step`` until all finish, after a
warm-up request. Measured on rank 0:

- step wall time (mean per step, and per generated token);
- collectives: the seconds rank 0 spends in the row-parallel all-reduces and in the step
  broadcasts (``TPGroup.seconds``), as a share of the step time, and per step;
- the scheduler's own cost per step (``Scheduler.schedule`` + ``update``, timed around the
  Rust calls), which the broadcast is compared with.

Every process shares the machine's cores (the ranks of a TP engine are separate processes, one
torch thread each), so on this 2-core CPU more ranks cannot be faster: the figures say what
the split and its communication cost, not what a GPU node would gain.

    python benches/bench_tp.py [--num-requests 16] [--max-tokens 32] [--sizes 1,3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402
from bench_engine import load_requests  # noqa: E402

from pagedkv.parallel.step_broadcast import empty_step  # noqa: E402

HEADING = "## Tensor parallelism on the CPU: step time, collectives, step broadcast (issue 14)"


class TimedScheduler:
    """Delegates to the engine's Rust scheduler, timing ``schedule`` and ``update``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seconds = 0.0

    def schedule(self) -> Any:
        t0 = time.perf_counter()
        try:
            return self._inner.schedule()
        finally:
            self.seconds += time.perf_counter() - t0

    def update(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._inner.update(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def random_llama(folder: str) -> str:
    """A random-weight Llama with SmolLM2-135M's shape but heads that divide by 2 (8 heads of
    72, 4 KV heads; 30 layers, hidden 576, MLP 1536, the same vocabulary): TP = 2 runs on it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def run(
    model: str | None, size: int, requests: list[tuple[list[int], int]], args: argparse.Namespace
) -> dict[str, Any]:
    import torch

    from pagedkv import LLMEngine, SamplingParams

    torch.set_num_threads(1)  # rank 0 like its workers: one thread per rank
    from pagedkv.worker.model_files import resolve_model

    engine = LLMEngine(
        model=model,
        tokenizer=None if model is None else resolve_model(None),
        device="cpu",
        dtype="float32",
        num_blocks=args.num_blocks,
        block_size=16,
        max_model_len=args.max_model_len,
        tensor_parallel_size=size,
    )
    try:
        engine.add_request("warm-up", {"prompt_token_ids": requests[0][0]}, SamplingParams(max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
        rank = engine.runner.tp_group  # rank 0's TPRank: its group counts the collectives
        group = None if rank is None else rank.group  # type: ignore[attr-defined]
        if group is not None:
            for kind in group.seconds:
                group.seconds[kind], group.calls[kind] = 0.0, 0
        timed = TimedScheduler(engine.scheduler)
        engine.scheduler = timed  # type: ignore[assignment]
        for i, (prompt, out_len) in enumerate(requests):
            params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        steps, tokens = 0, 0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += sum(len(c.token_ids) for c in out.outputs)
            steps += 1
        wall = time.perf_counter() - t0
        collectives = dict(group.seconds) if group is not None else {"all_reduce": 0.0, "broadcast": 0.0}
        calls = dict(group.calls) if group is not None else {"all_reduce": 0, "broadcast": 0}
        # The broadcast alone, with the workers idle in their receive: empty steps (the header
        # and a payload of empty arrays; every rank returns at once).
        empty_ms = float("nan")
        if group is not None:
            empty = empty_step()
            b0 = group.seconds["broadcast"]
            for _ in range(args.repeats):
                engine.runner.execute(empty)
                time.sleep(0.002)  # let the workers get back to their receive
            empty_ms = 1000 * (group.seconds["broadcast"] - b0) / args.repeats
        return {
            "model": "SmolLM2-135M" if model is None else "random Llama (8 heads, 4 KV)",
            "tp": size,
            "kv_heads_per_rank": engine.runner.num_kv_heads,
            "kv_bytes_per_rank": engine.runner.kv_cache_bytes,
            "steps": steps,
            "tokens": tokens,
            "wall_s": wall,
            "step_ms": 1000 * wall / steps,
            "tok_s": tokens / wall,
            "all_reduce_s": collectives["all_reduce"],
            "broadcast_s": collectives["broadcast"],
            "all_reduce_calls": calls["all_reduce"],
            "broadcast_calls": calls["broadcast"],
            "scheduler_s": timed.seconds,
            "empty_step_broadcast_ms": empty_ms,
        }
    finally:
        engine.shutdown()


def report(rows: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> str:
    table = md_table(
        [
            "model",
            "TP",
            "KV heads / rank",
            "KV MiB / rank",
            "steps",
            "step ms",
            "tok/s",
            "vs TP=1",
            "all-reduce ms / step (calls)",
            "broadcast ms / step (calls)",
            "collectives share",
            "scheduler ms / step",
            "broadcast / scheduler",
            "broadcast ms, idle workers",
        ],
        [
            [
                r["model"],
                r["tp"],
                r["kv_heads_per_rank"],
                f"{r['kv_bytes_per_rank'] / 2**20:.1f}",
                r["steps"],
                f"{r['step_ms']:.1f}",
                f"{r['tok_s']:.1f}",
                f"{r['tok_s'] / next(b for b in rows if b['model'] == r['model'])['tok_s']:.2f}x",
                f"{1000 * r['all_reduce_s'] / r['steps']:.2f} ({r['all_reduce_calls'] // max(1, r['steps'])})",
                f"{1000 * r['broadcast_s'] / r['steps']:.3f} ({r['broadcast_calls'] // max(1, r['steps'])})",
                f"{100 * (r['all_reduce_s'] + r['broadcast_s']) / r['wall_s']:.1f}%",
                f"{1000 * r['scheduler_s'] / r['steps']:.3f}",
                f"{r['broadcast_s'] / r['scheduler_s']:.2f}x" if r["tp"] > 1 else "-",
                f"{r['empty_step_broadcast_ms']:.3f}" if r["tp"] > 1 else "-",
            ]
            for r in rows
        ],
    )
    return (
        f"The embedded SmolLM2-135M-Instruct (30 layers, 9 heads, 3 KV heads: TP 1 or 3) and a random-weight "
        f"Llama of its size with heads that divide by 2 (8 heads, 4 KV heads: TP 1 or 2), float32, CPU, one torch "
        f"thread per rank (`mp` workers), {args.num_blocks} KV blocks of 16 tokens; {args.num_requests} "
        f"ShareGPT first turns, output capped at {args.max_tokens} tokens, greedy, `ignore_eos`, stepped "
        f"with `LLMEngine.step` after a warm-up request. Collectives: rank 0's seconds in the row-parallel "
        f"all-reduces (2 per layer per step) and the step broadcast (one 64 KiB frame: header and packed arrays); "
        f"scheduler: `Scheduler.schedule` + `update` per step. Rank 0's collective time includes waiting for the slowest rank. The last column times the broadcast alone: {args.repeats} empty steps sent while the workers wait in their receive.\n\n{table}\n\n"
        f"Benchmark run time: {seconds:.0f} s.\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--sizes", default="1,3", help="TP sizes for SmolLM2 (its 3 KV heads: 1 or 3)")
    ap.add_argument("--llama-sizes", default="1,2", help="TP sizes for the random Llama ('' to skip)")
    ap.add_argument("--repeats", type=int, default=50, help="empty steps timed for the idle broadcast")
    add_write_flag(ap)
    args = ap.parse_args()
    t0 = time.perf_counter()
    requests = load_requests(
        args.num_requests, max_prompt=256, max_output=args.max_tokens, max_model_len=args.max_model_len
    )
    rows = []
    runs: list[tuple[str | None, int]] = [(None, int(x)) for x in args.sizes.split(",") if x]
    folder = tempfile.mkdtemp(prefix="pagedkv-bench-tp-")
    try:
        if args.llama_sizes:
            llama = random_llama(folder)
            runs += [(llama, int(x)) for x in args.llama_sizes.split(",") if x]
        for model, size in runs:
            row = run(model, size, requests, args)
            rows.append(row)
            print(
                f"{row['model']} TP={size}: {row['steps']} steps, {row['step_ms']:.1f} ms/step, "
                f"{row['tok_s']:.1f} tok/s, all-reduce {row['all_reduce_s']:.2f} s, "
                f"broadcast {row['broadcast_s']:.3f} s, scheduler {row['scheduler_s']:.3f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    body = report(rows, args, time.perf_counter() - t0)
    print(body)
    if not args.no_write:
        write_section("tp", "python benches/bench_tp.py", body, HEADING)


if __name__ == "__main__":
    main()
