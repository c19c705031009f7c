"""What prompt logprobs cost: a 1k-token prompt prefilled with
``SamplingParams(prompt_logprobs=1)`` (what ``echo`` + ``logprobs`` asks for on
``/v1/completions``, and what lm-eval's loglikelihood requests send) against the same prefill
without them. Target: <= 1.2x.

Both requests compute the whole prompt (prefix caching is off, so neither starts on cached
blocks), generate one token, and alternate over the rounds; the figure is the median of the
per-round ratios, because the machine is shared and noisy.

Prompt logprobs need the LM head on every prompt position, not only the last: one more matmul
of [L - 1, hidden] x [hidden, vocab], whatever the implementation. Each round also times that
matmul alone (the model's head weight on random hidden states, into an output kept between
rounds as the engine's head keeps its buffer: ``worker/head_rows.py``), which gives the floor no
implementation can go under, ``(plain + head) / plain``, and what the rest costs above it (the
log-softmax, ranks and top-k, the bookkeeping). The machine's load average (1 minute) before
and after the rounds is printed and recorded: the figures are only as quiet as the machine. On SmolLM2-135M the head is 576 x 49152 against
a 30-layer body of ~106M parameters: its extra rows are ~23% of the prefill's FLOPs.

    python benches/bench_prompt_logprobs.py [--rounds N] [--tokens N] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import add_write_flag, md_table, write_section

from pagedkv import LLM, SamplingParams
from pagedkv.worker.model_files import default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length")
    add_write_flag(ap)
    args = ap.parse_args()

    model = str(default_model_dir())
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=args.tokens + 64,
        max_num_batched_tokens=args.tokens + 64,  # one prefill step for the whole prompt
        kv_cache_memory=256 << 20,
        enable_prefix_caching=False,
    )
    tokenizer = llm.get_tokenizer()
    text = " ".join(f"Sentence {i} of a long document about paged KV caches and their blocks." for i in range(400))
    ids = tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
    prompt = {"prompt_token_ids": ids}
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    with_logprobs = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)

    def run(params: SamplingParams) -> float:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        if params.prompt_logprobs is not None:
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        return elapsed

    weight = llm.llm_engine.runner.model.get_output_embeddings().weight  # [V, hidden]
    # [L - 1, hidden] in the model's dtype: the prompt rows the plain prefill does not compute.
    hidden = torch.randn(len(ids) - 1, weight.shape[1], dtype=weight.dtype)
    logits = torch.empty(len(ids) - 1, weight.shape[0], dtype=weight.dtype)  # [L - 1, V], kept

    def head_alone() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            torch.mm(hidden, weight.t(), out=logits)  # SmolLM2's head: a Linear without a bias
        return time.perf_counter() - start

    run(plain), run(with_logprobs), head_alone()  # warm-up
    load_before = os.getloadavg()[0]
    rows = []
    for round_ in range(args.rounds):
        first, second = (plain, with_logprobs) if round_ % 2 == 0 else (with_logprobs, plain)
        times = {id(first): run(first), id(second): run(second)}
        rows.append((times[id(plain)], times[id(with_logprobs)], head_alone()))
    load = f"load average {load_before:.2f} before the rounds, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)"
    plain_s = statistics.median(p for p, _, _ in rows)
    logprobs_s = statistics.median(w for _, w, _ in rows)
    head_s = statistics.median(h for _, _, h in rows)
    ratio = statistics.median(w / p for p, w, _ in rows)
    floor = statistics.median((p + h) / p for p, _, h in rows)
    above_floor = statistics.median(w / (p + h) for p, w, h in rows)
    met = "met" if ratio <= 1.2 else "NOT met"
    table = md_table(
        [
            "prompt tokens",
            "plain prefill s",
            "prefill + prompt_logprobs=1 s",
            "LM head on the extra rows alone s",
            "ratio",
            "floor (plain + head) / plain",
            "ratio / floor",
        ],
        [[len(ids), plain_s, logprobs_s, head_s, ratio, floor, above_floor]],
    )
    print(table)
    verdict = (
        f"Prompt logprobs cost {ratio:.2f}x a plain prefill (target <= 1.2x: {met}); the LM head's extra "
        f"rows alone put the floor at {floor:.2f}x, and everything else costs {above_floor:.2f}x above it "
        "(ratios are medians per round)."
    )
    print(verdict)
    print(load)
    if not args.no_write:
        body = (
            f"SmolLM2-135M float32 on the CPU, one {len(ids)}-token prompt, prefix caching off, one generated "
            f"token; the two requests alternate over {args.rounds} rounds (after a warm-up of each); {load}.\n\n"
            f"{table}\n\n{verdict}\n"
        )
        write_section(
            "Prompt logprobs: cost of echo + logprobs (issue 26)", "python benches/bench_prompt_logprobs.py", body
        )


if __name__ == "__main__":
    main()
