"""`pagedkv generate`: generate text for one or more prompts from the command line.

pagedkv generate --prompt "The capital of France is" --max-tokens 32 --temperature 0
pagedkv generate --model Qwen/Qwen2.5-0.5B-Instruct --chat --prompt "Tell me a joke"
pagedkv generate --prompt "Once upon a time" --swap-space 1 --preemption-mode auto

Sizes (``--kv-cache-memory``, ``--host-kv-cache-memory``, ``--kv-cache-dir-max-bytes``) are bytes,
or a size with a unit: ``512MiB``, ``8GiB``, ``1.5GB`` (the same in every command).

KV offload: ``--num-host-blocks`` / ``--host-kv-cache-memory`` / ``--swap-space`` (GiB)
size the host-memory tier (at most one), ``--preemption-mode`` picks what a preempted request's
KV does (``swap`` and ``auto`` need a host tier), ``--kv-cache-dir`` /
``--kv-cache-dir-max-bytes`` set up the disk tier.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedkv.cli.engine_args import add_engine_arguments
from pagedkv.config import PREEMPTION_MODES
from pagedkv.errors import PagedKVError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model id or folder, or gemma-3-270m (embedded; default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument(
        "--chat", action="store_true", help="apply the model's chat template (each prompt is a user message)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1, help="completions per prompt (share the prompt's KV blocks)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(
        p, ("dtype", "device", "max_model_len", "kv_cache_memory", "block_size", "kv_cache_dtype"), title="engine"
    )
    add_offload_arguments(p)
    p.add_argument("--json", action="store_true", help="print the outputs as JSON")


# The KV offload tier's EngineArgs fields, flags of `generate` and `demo`.
OFFLOAD_FIELDS = (
    "num_host_blocks",
    "host_kv_cache_memory",
    "swap_space",
    "preemption_mode",
    "kv_cache_dir",
    "kv_cache_dir_max_bytes",
)


def add_offload_arguments(p: argparse.ArgumentParser) -> None:
    """The KV offload tier's flags (EngineArgs' fields of ``OFFLOAD_FIELDS``); sizes in bytes or
    with a unit (``8GiB``); ``--preemption-mode`` checked by argparse."""
    add_engine_arguments(
        p,
        OFFLOAD_FIELDS,
        title="KV offload (host and disk tiers)",
        choices={"preemption_mode": PREEMPTION_MODES},
    )


def offload_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs of the offload flags that were given."""
    engine_args: dict[str, Any] = {"preemption_mode": args.preemption_mode}
    if args.num_host_blocks is not None:
        engine_args["num_host_blocks"] = args.num_host_blocks
    if args.host_kv_cache_memory is not None:
        engine_args["host_kv_cache_memory"] = args.host_kv_cache_memory
    if args.swap_space is not None:
        engine_args["swap_space"] = args.swap_space
    if args.kv_cache_dir is not None:
        engine_args["kv_cache_dir"] = args.kv_cache_dir
    if args.kv_cache_dir_max_bytes is not None:
        engine_args["kv_cache_dir_max_bytes"] = args.kv_cache_dir_max_bytes
    return engine_args


def run(args: argparse.Namespace) -> int:
    from pagedkv.engine.llm import LLM
    from pagedkv.sample.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        engine_args: dict[str, object] = {
            "dtype": args.dtype,
            "device": args.device,
            "block_size": args.block_size,
            "kv_cache_dtype": args.kv_cache_dtype,
            **offload_engine_args(args),
        }
        if args.max_model_len is not None:
            engine_args["max_model_len"] = args.max_model_len
        if args.kv_cache_memory is not None:
            engine_args["kv_cache_memory"] = args.kv_cache_memory
        llm = LLM(args.model, **engine_args)
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
        else:
            outs = llm.generate(args.prompt, params, use_tqdm=False)
        llm.shutdown()  # with --kv-cache-dir: the cached KV goes to the disk tier for the next run
    except PagedKVError as exc:
        print(f"pagedkv generate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "prompt": p,
                        "completions": [
                            {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                            for c in o.outputs
                        ],
                    }
                    for p, o in zip(args.prompt, outs)
                ],
                indent=2,
            )
        )
    else:
        for p, o in zip(args.prompt, outs):
            for c in o.outputs:
                tag = f" #{c.index}" if len(o.outputs) > 1 else ""
                print(f"--- prompt{tag}: {p!r}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    return 0
