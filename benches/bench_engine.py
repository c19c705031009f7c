"""End-to-end throughput (issue 5): pagedkv.LLM.generate against (a) transformers `generate`
with static batches padded to the batch's longest output and (b) transformers' own continuous
batching (the manager behind `generate_batch`), in one run, on the same requests: ShareGPT
first turns (SmolLM2 tokenizer) with their recorded output lengths, greedy, eos ignored,
max_tokens set per request. SmolLM2-135M-Instruct, float32, on this machine's CPU.

Targets: >= 2x (a) and >= 1.5x (b) in output tokens/s. Also reports the KV bytes each holds at
peak. The runners take a device and dtype, so benches/gpu_check.py reuses them on a GPU.

    python benches/bench_engine.py [--num-requests 64] [--max-output 2048] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import md_table, write_section  # noqa: E402

Requests = list[tuple[list[int], int]]  # (prompt token ids, output length)


def load_requests(n: int, max_prompt: int, max_output: int, max_model_len: int = 2048) -> Requests:
    """The first `n` ShareGPT first turns that pass vLLM's length filters."""
    from pagedkv.sim.workloads import sharegpt_first_turn_requests

    reqs = sharegpt_first_turn_requests(n * 3, max_prompt_len=max_prompt, max_model_len=max_model_len)
    return [(r.prompt_token_ids.tolist(), min(r.output_len, max_output)) for r in reqs][:n]


def run_pagedkv(
    requests: Requests,
    *,
    model: str | None = None,
    tokenizer: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    max_num_seqs: int = 64,
    budget: int = 2048,
    max_model_len: int = 2048,
    **kv_args: Any,
) -> dict:
    """pagedkv on `requests`; `kv_args`: kv_cache_memory / num_blocks / gpu_memory_utilization."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(
        model,
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        **kv_args,
    )
    engine = llm.llm_engine
    for i, (ids, n) in enumerate(requests):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    peak_blocks = produced = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                produced += len(o.outputs[0].token_ids)
        peak_blocks = max(peak_blocks, engine.scheduler.stats().num_used_blocks)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    runner = engine.runner
    return {
        "name": f"pagedkv LLM ({runner.attention_backend} attention)",
        "tokens": produced,
        "seconds": elapsed,
        "peak_kv_bytes": peak_blocks * runner.bytes_per_block,
        "num_blocks": runner.num_blocks,
        "bytes_per_block": runner.bytes_per_block,
        "note": f"{runner.num_blocks} blocks x {runner.block_size}, max_num_seqs {max_num_seqs}, budget {budget}, "
        f"{stats['num_preemptions']} preemptions",
    }


def load_hf(model_path: str | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    from pagedkv.worker.model_files import default_model_dir

    model = AutoModelForCausalLM.from_pretrained(
        model_path or default_model_dir(), dtype=dtype, attn_implementation="sdpa"
    )
    return model.to(device).eval()


def bytes_per_token(model: Any) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize


def run_hf_static(model: Any, requests: Requests, batch_size: int) -> dict:
    """Batches of `batch_size` in order, left-padded, each generating its longest output."""
    produced, peak = 0, 0
    device = model.device
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            batch = requests[b : b + batch_size]
            width = max(len(ids) for ids, _ in batch)
            longest = max(n for _, n in batch)
            input_ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for i, (ids, _) in enumerate(batch):
                input_ids[i, width - len(ids) :] = torch.tensor(ids)
                mask[i, width - len(ids) :] = 1
            model.generate(
                input_ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            # Only each request's own output counts; the rest of the batch's steps is padding.
            produced += sum(n for _, n in batch)
            peak = max(peak, len(batch) * (width + longest) * bytes_per_token(model))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "name": f"transformers generate, static batches of {batch_size}",
        "tokens": produced,
        "seconds": time.perf_counter() - start,
        "peak_kv_bytes": peak,
        "note": "padded to the batch's longest prompt and output",
    }


def run_hf_continuous(model: Any, requests: Requests, *, kv_bytes: int, budget: int, page: int = 16) -> dict:
    """transformers' continuous batching manager, per-request max_new_tokens, same KV budget."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    num_blocks = max(1, kv_bytes // (page * bytes_per_token(model)))
    gc = GenerationConfig(
        max_new_tokens=max(n for _, n in requests), do_sample=False, eos_token_id=None, pad_token_id=0
    )
    cbc = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=budget, page_size=page)
    start = time.perf_counter()
    mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    for i, (ids, n) in enumerate(requests):
        mgr.add_request(ids, request_id=f"r{i}", max_new_tokens=n)
    produced = 0
    for _ in range(len(requests)):
        r = mgr.get_result(timeout=3600)
        produced += len(r.generated_tokens)
    mgr.stop(block=True)
    return {
        "name": "transformers continuous batching (generate_batch manager)",
        "tokens": produced,
        "seconds": time.perf_counter() - start,
        "peak_kv_bytes": num_blocks * page * bytes_per_token(model),
        "note": f"{num_blocks} blocks x {page} preallocated, max_batch_tokens {budget}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=2048, help="cap on recorded output lengths (2048: none)")
    ap.add_argument("--kv-mib", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--static-batch", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="8 short requests (smoke run)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.max_output, args.no_write = 8, 16, True
    requests = load_requests(args.num_requests, args.max_prompt, args.max_output)
    kv = args.kv_mib << 20
    results = [run_pagedkv(requests, kv_cache_memory=kv, max_num_seqs=args.max_num_seqs, budget=args.budget)]
    model = load_hf()
    results.append(run_hf_static(model, requests, args.static_batch))
    results.append(run_hf_continuous(model, requests, kv_bytes=kv, budget=args.budget))
    base = results[0]["tokens"] / results[0]["seconds"]
    rows = []
    for r in results:
        tps = r["tokens"] / r["seconds"]
        rows.append([r["name"], r["tokens"], r["seconds"], tps, base / tps, r["peak_kv_bytes"] / 2**20, r["note"]])
    table = md_table(
        ["engine", "output tokens", "seconds", "output tok/s", "pagedkv speedup", "peak KV MiB", "notes"], rows
    )
    cap = "uncapped" if args.max_output >= 2048 else f"capped at {args.max_output}"
    desc = (
        f"{len(requests)} ShareGPT first turns (prompt <= {args.max_prompt} tokens, prompt + output <= 2048, recorded "
        f"output lengths {cap}; {sum(len(i) for i, _ in requests)} prompt / {sum(n for _, n in requests)} output "
        f"tokens), greedy, eos ignored; SmolLM2-135M-Instruct float32, CPU; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads."
    )
    print(desc)
    print(table)
    sa, sb = rows[1][4], rows[2][4]
    verdict = (
        f"\npagedkv vs static batching: {sa:.2f}x (target >= 2x: {'met' if sa >= 2 else 'NOT met'}); "
        f"vs transformers continuous batching: {sb:.2f}x (target >= 1.5x: {'met' if sb >= 1.5 else 'NOT met'})."
    )
    print(verdict)
    if not args.no_write:
        cmd = "python benches/bench_engine.py " + " ".join(sys.argv[1:])
        write_section(
            "Engine: CPU throughput vs transformers (issue 5)", cmd.strip(), desc + "\n\n" + table + "\n" + verdict
        )


if __name__ == "__main__":
    main()
