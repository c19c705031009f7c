"""`pagedkv generate`: generate text for one or more prompts from the command line.

pagedkv generate --prompt "The capital of France is" --max-tokens 32 --temperature 0
pagedkv generate --model Qwen/Qwen2.5-0.5B-Instruct --chat --prompt "Tell me a joke"
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedkv.errors import PagedKVError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="Hugging Face model id or folder (default: embedded SmolLM2-135M-Instruct)"
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
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes (CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache dtype: auto (the model's), int8, fp8 (= fp8_e4m3), fp8_e5m2 (quantized, a scale per token and head)",
    )
    p.add_argument("--json", action="store_true", help="print the outputs as JSON")


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
        engine_args = {
            "dtype": args.dtype,
            "device": args.device,
            "block_size": args.block_size,
            "kv_cache_dtype": args.kv_cache_dtype,
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
