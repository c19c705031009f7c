"""Weight precision on the CPU: SmolLM2-135M-Instruct with float32 weights, int8
weights (``quantization="int8"``) and bfloat16 weights (``dtype="bfloat16"``, which makes the
activations and the KV cache bfloat16 too): next-token quality against float32, and decode
throughput.

Quality, measured as benches/bench_kv_quality.py measures the quantized KV cache (its helpers
are imported): held-out ShareGPT assistant text (conversations 10,000 on), one teacher-forced
forward per sequence through pagedkv's paged attention per variant; per variant against
float32: mean / p99 / max KL(p_f32 || p_variant) in nats, top-1 agreement (and how many flips
are at near-ties, float32's top-2 within 0.1 nat of its top-1), perplexity of the actual next
tokens and its change.

Throughput: one engine per variant in one process, the same requests (random prompt ids,
greedy, eos ignored) through all of them with their steps interleaved one for one (so every
variant sees the same machine; benches/bench_kv_groups_engine.py's ``interleaved_round``),
at batch 1 and batch 16: output tokens per second of each engine's own step time, and CPU
milliseconds per output token.

    python benches/bench_weight_precision.py            # print the tables
    python benches/bench_weight_precision.py --write    # and record them in benches/RESULTS.md
    python benches/bench_weight_precision.py --quick    # a smoke run (never writes)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402
from bench_kv_groups_engine import interleaved_round  # noqa: E402
from bench_kv_quality import (  # noqa: E402
    HELD_OUT_START,
    NEAR_TIE,
    Acc,
    compare,
    held_out_sequences,
    make_step,
    overall_row,
    reference_stats,
    summarize,
)

from pagedkv import LLM  # noqa: E402

# name -> ModelConfig / LLM keyword arguments; the first is the reference.
VARIANTS: dict[str, dict[str, object]] = {
    "float32": {"dtype": "float32"},
    "int8 weights": {"dtype": "float32", "quantization": "int8"},
    "bfloat16": {"dtype": "bfloat16"},
}


def quality(args: argparse.Namespace) -> list[str]:
    from pagedkv.config import CacheConfig, ModelConfig
    from pagedkv.worker.model_runner import ModelRunner

    seqs, last_index = held_out_sequences(args.num_seqs, args.seq_len, HELD_OUT_START)
    num_blocks = -(-args.seq_len // args.block_size)
    runners = {
        name: ModelRunner(
            ModelConfig(device="cpu", max_model_len=args.seq_len, **kwargs),  # type: ignore[arg-type]
            CacheConfig(num_blocks=num_blocks, block_size=args.block_size),
        )
        for name, kwargs in VARIANTS.items()
    }
    reference, *others = VARIANTS
    accs = {name: Acc() for name in others}
    ref_nll, ref_gap = [], []
    for i, tokens in enumerate(seqs):
        step = make_step(tokens, args.block_size)
        targets = torch.from_numpy(tokens[1:])
        pos = np.arange(len(tokens) - 1)
        ref = runners[reference].execute(step)[:-1].float()  # the last position has no next token
        nll, gap = reference_stats(ref, targets)
        ref_nll.append(nll)
        ref_gap.append(gap)
        for name in others:
            accs[name].add(*compare(ref, runners[name].execute(step)[:-1].float(), targets), pos)
        print(f"  sequence {i + 1}/{len(seqs)}", flush=True)
    base_nll, base_gap = np.concatenate(ref_nll), np.concatenate(ref_gap)
    near_tie = base_gap < NEAR_TIE
    rows: list[list[object]] = [
        [reference, len(base_nll), 0.0, 0.0, 0.0, "100%", "-", "-", math.exp(float(base_nll.mean())), "-"]
    ]
    for name in others:
        kl, agree, nll, _ = accs[name].arrays()
        rows.append(overall_row(name, summarize(kl, agree, nll, base_nll), agree, near_tie))
    header = [
        "weights",
        "positions",
        "mean KL (nats)",
        "p99 KL",
        "max KL",
        "top-1 agreement",
        "top-1 flips (at near-ties)",
        "top-1 agreement, gap >= 0.1 nat",
        "perplexity",
        "vs float32",
    ]
    return [
        f"Quality, teacher-forced: {len(seqs)} held-out ShareGPT sequences of {args.seq_len} tokens "
        f"(assistant turns of conversations {HELD_OUT_START}..{last_index}), {len(base_nll):,} next-token "
        f"positions per variant, one forward per sequence through the paged attention (block size "
        f"{args.block_size}); KL(p_float32 || p_variant) in nats, float64 log_softmax.",
        "",
        md_table(header, rows),
    ]


def throughput(args: argparse.Namespace) -> list[str]:
    rng = np.random.default_rng(0)
    rows: list[list[object]] = []
    for batch in args.batches:
        prompts = [rng.integers(1000, 40_000, args.prompt_len).tolist() for _ in range(batch)]
        llms = {
            name: LLM(max_model_len=args.prompt_len + args.max_tokens + 16, max_num_seqs=batch, **kwargs)  # type: ignore[arg-type]
            for name, kwargs in VARIANTS.items()
        }
        interleaved_round(llms, prompts[:1], 2, next(iter(llms)))  # warm-up, outside the figures
        order = list(llms)
        rounds = [interleaved_round(llms, prompts, args.max_tokens, order[k % len(order)]) for k in range(args.rounds)]
        tokens = batch * args.max_tokens * args.rounds
        reference = next(iter(llms))
        ref_wall = sum(r[reference]["wall"] for r in rounds)
        for name, llm in llms.items():
            wall = sum(r[name]["wall"] for r in rounds)
            cpu = sum(r[name]["cpu"] for r in rounds)
            rows.append(
                [f"B={batch}", name, f"{tokens / wall:.2f}", f"{1000 * cpu / tokens:.1f}", f"{ref_wall / wall:.2f}x"]
            )
            llm.shutdown()
    return [
        f"Throughput: the same requests ({args.prompt_len} random prompt ids each, {args.max_tokens} greedy "
        f"output tokens, eos ignored) through one engine per variant in one process, their steps "
        f"interleaved one for one, {args.rounds} rounds; output tok/s over each engine's own step time "
        f"(prefill included).",
        "",
        md_table(["batch", "weights", "output tok/s", "CPU ms / output token", "vs float32 (wall)"], rows),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 sequences of 160 tokens, batch 2, 1 round")
    add_write_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.num_seqs, args.seq_len, args.batches, args.max_tokens, args.rounds = 2, 160, [2], 8, 1
        args.no_write = True
    started = time.perf_counter()
    lines = [
        f"SmolLM2-135M-Instruct (embedded) on the CPU, torch {torch.__version__}, {torch.get_num_threads()} threads. "
        "int8 weights: every linear (the LM head too) as int8 with a float32 scale per output channel, "
        "pagedkv's CPU linear kernel on float32 inputs (python/pagedkv/worker/int8_linear.py, rust/cpu_linear.rs); "
        "bfloat16: `dtype='bfloat16'`, the whole model and its KV cache in bfloat16.",
        "",
        *quality(args),
        "",
        *throughput(args),
        "",
        f"Total {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at the end (2 CPUs).",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(
            "weight-precision",
            "python benches/bench_weight_precision.py --write",
            body,
            heading="## Weight precision: quality and throughput of int8 and bfloat16 weights (issue 29)",
        )


if __name__ == "__main__":
    main()
