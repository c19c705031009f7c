"""`pagedkv demo` (and `make demo`): batched generation over ShareGPT prompts on the embedded
SmolLM2-135M-Instruct, on the CPU or a GPU, with the paged KV cache's figures.

It takes the first user turns of ShareGPT conversations, renders them with the model's chat
template (which adds the same system prompt to each: a shared prefix for the prefix cache),
generates for all of them at once under a deliberately small KV budget (so paging, sharing
and preemption all show), and prints a few completions, the throughput, and what the KV cache
did: peak usage, memory utilization (tokens held / slots allocated), prefix-cache hit rate,
preemptions.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from typing import Any

from pagedkv.errors import PagedKVError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer ShareGPT prompts")
    p.add_argument("--kv-cache-memory", type=int, default=256, help="KV cache MiB (CPU; default 256)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache dtype: auto (the model's), int8, fp8 (= fp8_e4m3), fp8_e5m2 (quantized, a scale per token and head)",
    )
    p.add_argument("--max-num-seqs", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=3, help="completions to print")
    p.add_argument("--device", default="auto")


def _sharegpt_prompts(tokenizer: Any, num: int, max_tokens: int) -> list[tuple[str, list[int]]]:
    """(question, chat-rendered token ids) of the first `num` ShareGPT user turns that fit."""
    from pagedkv.engine.prompts import chat_prompt
    from pagedkv.sim.workloads import load_sharegpt_conversations

    prompts = []
    for conv in load_sharegpt_conversations():
        if not conv.turns or conv.turns[0].role != "human" or not conv.turns[0].text.strip():
            continue
        question = conv.turns[0].text.strip()
        ids = chat_prompt(tokenizer, [{"role": "user", "content": question}])["prompt_token_ids"]
        if len(ids) <= max_tokens:
            prompts.append((question, ids))
        if len(prompts) == num:
            break
    return prompts


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.sample.sampling_params import SamplingParams

    t_load = time.perf_counter()
    try:
        engine = LLMEngine(
            model=args.model,
            device=args.device,
            kv_cache_memory=args.kv_cache_memory << 20,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.max_num_seqs,
            max_model_len=2048,
            seed=args.seed,
        )
    except PagedKVError as exc:
        print(f"pagedkv demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    runner = engine.runner
    print(
        f"model {runner.model_path} ({runner.dtype}, {runner.device}, attention: {runner.attention_backend}), "
        f"loaded in {time.perf_counter() - t_load:.1f} s"
    )
    print(
        f"KV cache: {runner.num_blocks} blocks x {runner.block_size} tokens = {runner.num_blocks * runner.block_size} "
        f"token slots, {runner.kv_cache_bytes / 2**20:.0f} MiB, KV dtype {runner.geometry.dtype} "
        f"({runner.geometry.bytes_per_token} bytes/token)"
    )
    prompts = _sharegpt_prompts(engine.tokenizer, args.num_prompts, args.max_prompt_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    for i, (_, ids) in enumerate(prompts):
        engine.add_request(f"sharegpt-{i}", ids, params)
    print(
        f"{len(prompts)} ShareGPT prompts ({sum(len(ids) for _, ids in prompts)} tokens), max_tokens={args.max_tokens}"
    )

    finished = {}
    peak_usage = 0.0
    held = slots = 0
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="generating", unit="req", dynamic_ncols=True) as bar:
        while engine.has_unfinished_requests():
            outs = engine.step()
            st = engine.scheduler.stats()
            peak_usage = max(peak_usage, st.kv_usage)
            held += st.tokens_held
            slots += st.slots_allocated
            for o in outs:
                if o.finished:
                    finished[o.request_id] = o
                    bar.update(1)
            generated = engine.get_stats()["generation_tokens"]
            bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.0f} output tok/s, KV {st.kv_usage:.0%}")
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()

    for i, (question, _) in enumerate(prompts[: args.show]):
        out = finished[f"sharegpt-{i}"].outputs[0]
        print(f"\n--- prompt {i}: {textwrap.shorten(question, 150)}")
        print(textwrap.indent(textwrap.fill(out.text.strip(), 100) or "(empty)", "    "))
        print(f"    [{len(out.token_ids)} tokens, {out.finish_reason}]")
    gen = stats["generation_tokens"]
    print("\n=== pagedkv demo ===")
    print(f"requests           {len(finished)} in {elapsed:.1f} s ({stats['steps']} steps)")
    print(
        f"throughput         {gen / elapsed:.1f} output tokens/s, {stats['tokens_computed'] / elapsed:.1f} tokens computed/s"
    )
    print(
        f"KV cache           {stats['kv_cache_dtype']}, {stats['kv_bytes_per_token']} bytes/token, "
        f"{stats['num_blocks']} blocks in {stats['kv_cache_bytes'] / 2**20:.0f} MiB"
    )
    print(f"KV usage           peak {peak_usage:.0%} of {stats['num_blocks']} blocks")
    print(f"KV utilization     {held / max(slots, 1):.1%} of allocated slots hold a token (time-averaged)")
    print(
        f"prefix cache       {stats['prefix_cache_hit_rate']:.1%} of prompt tokens hit "
        f"({stats['prefix_cache_hits']} / {stats['prefix_cache_queries']})"
    )
    print(
        f"preemptions        {stats['num_preemptions']} (recompute; {stats['resumed_prefix_hits']} tokens re-read from the cache on resume)"
    )
    return 0
