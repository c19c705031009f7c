"""Capacity and memory studies on ShareGPT and synthetic traffic, with plots.

Runs the studies of :mod:`studies` through the real Rust scheduler and writes
``benches/results/<study>.png|json|md`` plus one section per study in benches/RESULTS.md:

* breakdown          KV memory breakdown, paging vs contiguous reservation (ShareGPT first turns)
* block_size         block sizes 8..256 in a fixed budget (first turns and multi-turn ShareGPT)
* parallel_sampling  n = 2, 4, 6 forked samples vs n independent requests
* prefix_cache       hit rate and prefill saved vs cache size (multi-turn ShareGPT, system prompts)
* memory_map         the pool's physical blocks over a short ShareGPT run
* speed              replay_paged on 10,000 ShareGPT requests (tokenization timed apart)
* offload_swap       KV offload tier: recompute vs swap vs auto preemption (the breakdown's workload and pool)
* offload_prefix_cache  KV offload tier: multi-turn prefix hits with a host tier of 0x..4x the device pool
* offload_retention  KV offload tier: retention priorities over the system prompts (retention_tokens)

    python benches/run_studies.py                      # all of them, full size (a few minutes)
    python benches/run_studies.py --study prefix_cache # one (repeatable: --study a --study b)
    python benches/run_studies.py --quick              # small sizes into a temporary folder, no RESULTS.md

ShareGPT prompts and replies are tokenized with SmolLM2's tokenizer (the embedded default
model); output lengths are the recorded replies' token counts. Studies with a host tier take
the bytes per block (copy time) from SmolLM2's KV geometry (float32 KV, 720 KiB per block of 16).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, write_section  # noqa: E402
from studies import (  # noqa: E402
    StudyResult,
    block_size_study,
    breakdown_study,
    memory_map_study,
    parallel_sampling_study,
    prefix_cache_study,
    speed_study,
)
from studies.offload import host_tier_prefix_study, retention_study, swap_study  # noqa: E402
from studies.prefix_cache import default_pool_sizes  # noqa: E402

from pagedkv.sim.kv_budget import load_kv_geometry  # noqa: E402
from pagedkv.sim.workloads import (  # noqa: E402
    ArrivalProcess,
    TraceRequest,
    assign_arrivals,
    default_tokenizer,
    load_sharegpt_conversations,
    shared_prefix_requests,
    sharegpt_first_turn_requests,
    sharegpt_multi_turn_requests,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SEED = 0
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16
NUM_SLOTS = 32_768  # 2,048 blocks of 16: 1.4 GiB of KV for SmolLM2 in fp32, 25 GiB for a 13B Llama in fp16
MULTI_TURN_SLOTS = 262_144  # 16,384 blocks of 16: keeps conversations cached between turns
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
SPEED_REQUESTS = 10_000
SPEED_MAX_MODEL_LEN = 4096  # 10,000 first turns need prompts over 1,024 tokens too

SIZES = {  # full, quick
    "first_turns": (2000, 120),
    "parallel_requests": (1000, 60),
    "conversations": (1000, 40),
    "system_prompt_requests": (3000, 200),
    "map_requests": (48, 24),
    "speed_requests": (SPEED_REQUESTS, 400),
}


class Workloads:
    """Builds each workload once; times the ShareGPT loading and tokenization apart."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.timings: dict[str, float] = {}

    def size(self, name: str) -> int:
        return SIZES[name][1 if self.quick else 0]

    def _timed(self, name: str, build: Callable[[], object]) -> object:
        started = time.perf_counter()
        value = build()
        self.timings[name] = time.perf_counter() - started
        return value

    @cache  # noqa: B019 (one instance per run)
    def conversations(self) -> list:
        return self._timed("load ShareGPT conversations", load_sharegpt_conversations)  # type: ignore[return-value]

    @cache  # noqa: B019
    def all_first_turns(self) -> list[TraceRequest]:
        """Shuffled ShareGPT first turns up to SPEED_MAX_MODEL_LEN, no separate prompt cap."""
        conversations = self.conversations()
        self._timed("load tokenizer", default_tokenizer)
        return self._timed(  # type: ignore[return-value]
            "tokenize first turns",
            lambda: sharegpt_first_turn_requests(
                self.size("speed_requests"),
                max_prompt_len=None,
                max_model_len=SPEED_MAX_MODEL_LEN,
                shuffle_seed=SEED,
                conversations=conversations,
            ),
        )

    @cache  # noqa: B019
    def first_turns(self) -> list[TraceRequest]:
        """The vLLM benchmark filter at MAX_MODEL_LEN: prompt <= 1024, prompt + output <= MAX_MODEL_LEN."""
        return [
            r for r in self.all_first_turns() if r.prompt_len <= 1024 and r.prompt_len + r.output_len <= MAX_MODEL_LEN
        ]

    @cache  # noqa: B019
    def multi_turn(self) -> list[TraceRequest]:
        """Conversations starting 2/s (Poisson); each next turn 30 s after the previous one."""
        conversations = self.conversations()
        return self._timed(  # type: ignore[return-value]
            "tokenize multi-turn",
            lambda: sharegpt_multi_turn_requests(
                self.size("conversations"),
                max_model_len=MAX_MODEL_LEN,
                arrivals=ArrivalProcess(rate=2.0),
                turn_interval_s=30.0,
                arrival_seed=SEED,
                shuffle_seed=SEED,
                conversations=conversations,
            ),
        )

    @cache  # noqa: B019
    def system_prompts(self) -> list[TraceRequest]:
        """32 system prompts of 256..1536 tokens with Zipf(1) popularity, 8 requests/s (Poisson)."""
        prefix_lens = [int(x) for x in np.random.default_rng(SEED).integers(256, 1537, size=32)]
        return shared_prefix_requests(
            self.size("system_prompt_requests"),
            num_prefixes=32,
            prefix_len=prefix_lens,
            user_len=(16, 256),
            output_len=(16, 512),
            zipf_s=1.0,
            seed=SEED,
            arrivals=ArrivalProcess(rate=8.0),
        )


SYSTEM_PROMPTS_DESCRIPTION = "32 system prompts of 256-1536 tokens, Zipf(1) popularity, 16-256 private prompt tokens, 16-512 output tokens, 8 requests/s"
MULTI_TURN_DESCRIPTION = (
    "conversations start at 2/s (Poisson), turns 30 s apart, each prompt = the whole conversation so far"
)


def run_breakdown(w: Workloads, out: Path) -> StudyResult:
    return breakdown_study(
        w.first_turns()[: w.size("first_turns")],
        out,
        num_slots=NUM_SLOTS,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        workload_label="ShareGPT first turns",
    )


def run_block_size(w: Workloads, out: Path) -> StudyResult:
    return block_size_study(
        {
            "ShareGPT first turns (all at t=0)": w.first_turns()[: w.size("first_turns")],
            "ShareGPT multi-turn": w.multi_turn(),
        },
        # Multi-turn gets a pool large enough to keep conversations cached between turns, so
        # the block size's effect on hits shows (see the prefix_cache study for smaller pools).
        out,
        num_slots={"ShareGPT first turns (all at t=0)": NUM_SLOTS, "ShareGPT multi-turn": MULTI_TURN_SLOTS},
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )


def run_parallel_sampling(w: Workloads, out: Path) -> StudyResult:
    count = w.size("parallel_requests")
    return parallel_sampling_study(
        {"ShareGPT first turns": w.first_turns()[:count], "ShareGPT multi-turn": w.multi_turn()[:count]},
        out,
        sample_counts=(2, 4, 6),
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )


def run_prefix_cache(w: Workloads, out: Path) -> StudyResult:
    return prefix_cache_study(
        {"ShareGPT multi-turn": w.multi_turn(), "shared system prompts": w.system_prompts()},
        out,
        pool_sizes=default_pool_sizes(MAX_MODEL_LEN, BLOCK_SIZE, 32_768 if not w.quick else 1024),
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        descriptions={
            "ShareGPT multi-turn": MULTI_TURN_DESCRIPTION,
            "shared system prompts": SYSTEM_PROMPTS_DESCRIPTION,
        },
    )


@cache
def kv_geometry_label() -> tuple[int, str]:
    """(bytes per block, a description) of the embedded SmolLM2's KV: the copy cost of a block."""
    geometry = load_kv_geometry()
    return geometry.bytes_per_block(BLOCK_SIZE), f" (SmolLM2-135M, {geometry.describe()})"


def run_offload_swap(w: Workloads, out: Path) -> StudyResult:
    bytes_per_block, label = kv_geometry_label()
    return swap_study(
        w.first_turns()[: w.size("first_turns")],
        out,
        num_blocks=NUM_SLOTS // BLOCK_SIZE,
        bytes_per_block=bytes_per_block,
        host_multiple=4,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        workload_label="ShareGPT first turns (all at t = 0)",
        geometry_label=label,
    )


def run_offload_prefix_cache(w: Workloads, out: Path) -> StudyResult:
    bytes_per_block, label = kv_geometry_label()
    return host_tier_prefix_study(
        w.multi_turn(),
        out,
        device_pools=(8192, 16384) if not w.quick else (128, 256),
        bytes_per_block=bytes_per_block,
        host_multiples=(0, 1, 2, 4),
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        workload_label="ShareGPT multi-turn",
        description=MULTI_TURN_DESCRIPTION,
        geometry_label=label,
    )


def run_offload_retention(w: Workloads, out: Path) -> StudyResult:
    # 1,024 blocks: the running set alone overfills the pool (preemptions) and the cache
    # thrashes; 2,048: some preemptions; 4,096: none, but the 32 system prompts (1,792 blocks)
    # compete with the running sequences for the rest (81% against 86% unbounded, prefix_cache
    # study). Priorities over the system prompt (retention_tokens = its length), for good and
    # for 3 simulated seconds, against the earlier whole-prompt priority; k = 32 is every prompt.
    return retention_study(
        w.system_prompts(),
        out,
        pool_sizes=(1024, 2048, 4096) if not w.quick else (128, 256),
        top_counts=(1, 2, 4, 32),
        priority=80,
        variants=(("system prompt", None), ("system prompt", 3.0), ("whole prompt", None)),
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        workload_label="shared system prompts",
        description=SYSTEM_PROMPTS_DESCRIPTION,
    )


def run_memory_map(w: Workloads, out: Path) -> StudyResult:
    # Short requests so a few dozen of them churn through a small pool; every fourth asks for
    # two parallel samples (their shared prompt blocks show up black until copy-on-write).
    short = [r for r in w.first_turns() if r.prompt_len + r.output_len <= 1024][: w.size("map_requests")]
    short = [
        r if i % 4 else TraceRequest(r.request_id, 0.0, r.prompt_token_ids, r.output_len, n=2)
        for i, r in enumerate(short)
    ]
    requests = assign_arrivals(short, ArrivalProcess(rate=3.0), seed=SEED)
    # With a host tier of twice the pool: preempted sequences are swapped out and back, and
    # evicted cached blocks are written back (the host-pool panel).
    bytes_per_block, _ = kv_geometry_label()
    return memory_map_study(
        requests,
        out,
        num_host_blocks=320,
        preemption_mode="swap",
        bytes_per_block=bytes_per_block,
        num_blocks=160,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        workload_label="ShareGPT first turns, 3 requests/s",
    )


def run_speed(w: Workloads, out: Path) -> StudyResult:
    requests = w.all_first_turns()
    tokenization = w.timings.get("tokenize first turns")
    result = speed_study(
        requests,
        out,
        num_blocks=4096,
        block_size=BLOCK_SIZE,
        max_model_len=SPEED_MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        tokenization_s=tokenization,
        workload_label="ShareGPT first turns (shuffled, prompt + output <= 4096)",
    )
    setup = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in w.timings.items())
    result.body += f"\n\nWorkload preparation in this run (apart from the replay): {setup}."
    result.data["preparation_s"] = dict(w.timings)
    return result


STUDIES: dict[str, tuple[str, Callable[[Workloads, Path], StudyResult]]] = {
    "breakdown": ("Study: KV memory breakdown (issue 6)", run_breakdown),
    "block_size": ("Study: block size (issue 6)", run_block_size),
    "parallel_sampling": ("Study: parallel sampling (issue 6)", run_parallel_sampling),
    "prefix_cache": ("Study: prefix caching vs cache size (issue 6)", run_prefix_cache),
    "memory_map": ("Study: memory map (issue 6)", run_memory_map),
    "speed": ("Study: simulation speed (issue 6)", run_speed),
    "offload_swap": ("Study: KV offload tier, recompute vs swap vs auto preemption (issue 11)", run_offload_swap),
    "offload_prefix_cache": (
        "Study: KV offload tier, prefix caching with a host tier (issue 11)",
        run_offload_prefix_cache,
    ),
    "offload_retention": ("Study: KV offload tier, retention priorities (issue 11)", run_offload_retention),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", action="append", choices=list(STUDIES), help="run only this study (repeatable)")
    parser.add_argument("--quick", action="store_true", help="small sizes, into a temporary folder, no RESULTS.md")
    parser.add_argument("--out", type=Path, default=None, help=f"output folder [default: {RESULTS_DIR}]")
    add_write_flag(parser)
    args = parser.parse_args()
    out = args.out or (Path(tempfile.mkdtemp(prefix="pagedkv-studies-")) if args.quick else RESULTS_DIR)
    workloads = Workloads(args.quick)
    for name in args.study or list(STUDIES):
        title, run = STUDIES[name]
        started = time.perf_counter()
        result = run(workloads, out)
        elapsed = time.perf_counter() - started
        files = result.write(out)
        print(f"== {name}: {elapsed:.1f} s -> {', '.join(str(f) for f in files)}")
        print(result.markdown(str(out) + "/"))
        print()
        if not (args.quick or args.no_write):
            command = f"python benches/run_studies.py --study {name}"
            write_section(title, command, result.markdown("results/") + f"\n\nStudy run time: {elapsed:.1f} s.")


if __name__ == "__main__":
    main()
