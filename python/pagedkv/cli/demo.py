"""`pagedkv demo` (and `make demo`): batched generation over ShareGPT prompts on the embedded
SmolLM2-135M-Instruct, on the CPU or a GPU, with the paged KV cache's figures.

It takes the first user turns of ShareGPT conversations, renders them with the model's chat
template (which adds the same system prompt to each: a shared prefix for the prefix cache),
generates for all of them at once under a deliberately small KV budget (so paging, sharing
and preemption all show), and prints a few completions, the throughput, and what the KV cache
did: peak usage, memory utilization (tokens held / slots allocated), prefix-cache hit rate,
preemptions.

With a host-memory KV tier (``--num-host-blocks`` / ``--host-kv-cache-memory`` (a size: ``1GiB``) /
``--swap-space`` GiB) and ``--preemption-mode swap|auto``, preempted requests' KV is swapped to
the host and back instead of recomputed, and the summary adds what the tiers did: host blocks
and bytes, host usage, swap vs recompute preemptions, blocks and bytes swapped each way,
write-backs, host prefix hits, and the swap bandwidth measured at start. With ``--kv-cache-dir``
(the disk tier) the cached KV is flushed down the tiers at exit, so a second run on the same folder
starts with those prefixes cached; the summary then prints the disk tier's counters. Without a
tier the output is the same as before the tiers existed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
import time
from typing import Any

from pagedkv.cli.engine_args import add_engine_arguments
from pagedkv.cli.generate import add_offload_arguments, offload_engine_args
from pagedkv.errors import PagedKVError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model id or folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer ShareGPT prompts")
    # The engine's flags, with the demo's own pool (CPU-sized), context and batch.
    add_engine_arguments(
        p,
        ("device", "kv_cache_memory", "block_size", "max_model_len", "kv_cache_dtype", "max_num_seqs"),
        title="engine",
        defaults={"kv_cache_memory": "256MiB", "max_model_len": 2048, "max_num_seqs": 48},
    )
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=3, help="completions to print")
    add_offload_arguments(p)


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


def _forward_origin(runner: Any) -> str:
    """ "eager", or how the compiled forward was made and in how long."""
    forward = runner.compiled_forward
    if forward is None:
        return "eager"
    seconds = "" if forward.seconds is None else f" in {forward.seconds:.1f} s"
    return f"compiled ({forward.origin}{seconds})"


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.sample.sampling_params import SamplingParams

    # The compiled forward's log lines (compiling / loaded, and how long) reach the terminal: a
    # machine's first start compiles for about a minute, and should say so.
    logging.basicConfig(format="%(message)s")
    logging.getLogger("pagedkv.worker.compiled_forward").setLevel(logging.INFO)
    t_load = time.perf_counter()
    try:
        engine = LLMEngine(
            model=args.model,
            device=args.device,
            kv_cache_memory=args.kv_cache_memory,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            seed=args.seed,
            **offload_engine_args(args),
        )
    except PagedKVError as exc:
        print(f"pagedkv demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    runner = engine.runner
    print(
        f"model {runner.model_path} ({runner.dtype}, {runner.device}, attention: {runner.attention_backend}, "
        f"linears: {runner.linear_kernel}, forward: {_forward_origin(runner)}), "
        f"loaded in {time.perf_counter() - t_load:.1f} s"
    )
    print(
        f"KV cache: {runner.num_blocks} blocks x {runner.block_size} tokens = {runner.num_blocks * runner.block_size} "
        f"token slots, {runner.kv_cache_bytes / 2**20:.0f} MiB, KV dtype {runner.geometry.dtype} "
        f"({runner.geometry.bytes_per_token} bytes/token)"
    )
    host_tier = runner.num_host_blocks > 0
    if host_tier:
        print(
            f"host KV tier: {runner.num_host_blocks} blocks = {runner.num_host_blocks * runner.block_size} token "
            f"slots, {runner.host_kv_cache_bytes / 2**20:.0f} MiB; preemption mode "
            f"{engine.config.scheduling.preemption_mode}; swap bandwidth {_gbps(engine.swap_bandwidth)} "
            f"(measured round trip)"
        )
    prompts = _sharegpt_prompts(engine.tokenizer, args.num_prompts, args.max_prompt_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    for i, (_, ids) in enumerate(prompts):
        engine.add_request(f"sharegpt-{i}", ids, params)
    print(
        f"{len(prompts)} ShareGPT prompts ({sum(len(ids) for _, ids in prompts)} tokens), max_tokens={args.max_tokens}"
    )

    finished = {}
    peak_usage = peak_host_usage = 0.0
    held = slots = 0
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="generating", unit="req", dynamic_ncols=True) as bar:
        while engine.has_unfinished_requests():
            outs = engine.step()
            st = engine.scheduler.stats()
            peak_usage = max(peak_usage, st.kv_usage)
            peak_host_usage = max(peak_host_usage, st.host_kv_usage)
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
    if not host_tier:
        print(
            f"preemptions        {stats['num_preemptions']} (recompute; {stats['resumed_prefix_hits']} tokens re-read from the cache on resume)"
        )
    else:
        _print_tiers(stats, peak_host_usage, engine.config.scheduling.preemption_mode)
    if args.kv_cache_dir is not None:
        limit = "no limit" if args.kv_cache_dir_max_bytes is None else f"at most {args.kv_cache_dir_max_bytes:,} bytes"
        # The disk tier's counters (whichever the engine reports: names with "disk"), after the flush.
        # The disk tier keeps what the engine flushes at shutdown (for the next run on this folder).
        flushed = engine.flush_kv_cache() if engine.runner.disk_cache is not None else 0
        after = engine.get_stats()
        counters = ", ".join(f"{k} {v}" for k, v in after.items() if "disk" in k and isinstance(v, int))
        counters = f"{flushed} blocks flushed down the tiers at exit; {counters}"
        print(f"disk tier          {args.kv_cache_dir} ({limit}){'; ' + counters if counters else ''}")
    return 0


def _gbps(bytes_per_s: float | None) -> str:
    return "n/a" if not bytes_per_s else f"{bytes_per_s / 1e9:.2f} GB/s"


def _print_tiers(stats: dict[str, Any], peak_host_usage: float, mode: str) -> None:
    """The summary lines of the host tier (only printed when there is one)."""
    swaps, total = stats["num_swap_preemptions"], stats["num_preemptions"]
    print(
        f"preemptions        {total}: {swaps} swap, {total - swaps} recompute (mode {mode}; "
        f"{stats['resumed_prefix_hits']} tokens re-read from the cache on resume)"
    )
    print(
        f"host tier          {stats['num_host_blocks']} blocks in {stats['host_kv_cache_bytes'] / 2**20:.0f} MiB; "
        f"usage peak {peak_host_usage:.0%}, now {stats['host_kv_usage']:.0%} "
        f"({stats['num_host_cached_blocks']} blocks cached, {stats['num_host_evictions']} evicted)"
    )
    print(
        f"swapped            out {stats['blocks_swapped_out']} blocks ({stats['bytes_swapped_out'] / 2**20:.1f} MiB), "
        f"in {stats['blocks_swapped_in']} blocks ({stats['bytes_swapped_in'] / 2**20:.1f} MiB)"
    )
    print(
        f"write-backs        {stats['num_write_backs']} evicted cached blocks copied to the host, "
        f"{stats['num_write_backs_skipped']} skipped (host full)"
    )
    hits, host_hits = stats["prefix_cache_hits"], stats["prefix_cache_host_hits"]
    print(
        f"host prefix hits   {host_hits} tokens ({host_hits / hits if hits else 0.0:.1%} of prefix-cache hits, "
        f"loaded back from the host)"
    )
    recompute = stats["recompute_tokens_per_s"]
    rate = "n/a" if recompute is None else f"{recompute:.0f} tokens/s"
    print(
        f"swap bandwidth     {_gbps(stats['swap_bandwidth_bytes_per_s'])} (device -> host -> device, measured at "
        f"start); recompute {rate}"
    )
