"""End-to-end throughput: pagedkv.LLM.generate against (a) transformers `generate`
with static batches padded to the batch's longest output and (b) transformers' own continuous
batching (the manager behind `generate_batch`), in one run, on the same requests: ShareGPT
first turns (SmolLM2 tokenizer) with their recorded output lengths, greedy, eos ignored,
max_tokens set per request. SmolLM2-135M-Instruct, float32, on this machine's CPU.

Targets: >= 2x (a) and >= 1.5x (b) in output tokens/s. Also reports the KV bytes each holds at
peak. The runners take a device and dtype, so benches/gpu_check.py reuses them on a GPU.

    python benches/bench_engine.py [--num-requests 64] [--max-output 2048] [--kv-cache-dtype auto] [--quick]

KV cache dtype: ``--kv-cache-dtype`` sets pagedkv's ``kv_cache_dtype`` in the
comparison above. ``--kv-dtypes auto,int8`` instead runs only pagedkv, once per KV dtype, on the
same requests with the same ``kv_cache_memory`` (each ``--compare-kv-mib`` budget; default
``--kv-mib``), one after the other in one process: output tok/s, the KV blocks each pool got,
the peak KV blocks / bytes used, the peak running sequences, preemptions, and how many greedy
outputs equal the first dtype's token for token (a quantized cache may move a greedy near-tie).
It writes its own section of RESULTS.md.

    python benches/bench_engine.py --kv-dtypes auto,int8 [--compare-kv-mib 512,128]

Preemption modes: ``--preemption-modes recompute,auto,swap`` runs only pagedkv, once
per mode, on the same requests with a KV pool small enough (``--kv-mib``) that requests are
preempted, one after the other in one process. ``recompute`` runs without a host tier (the
engine before the offload tier); ``recompute+host`` recomputes but has the host tier (evicted
cached blocks are written back and found there again); ``swap`` and ``auto`` get a host tier of
``--host-mib``. It reports output tok/s (and the ratio to recompute), mean / p50 / p90 time to
first token, swap vs recompute preemptions, tokens computed, bytes swapped each way,
write-backs, host prefix hits, and how many greedy outputs equal the first mode's. ``--rounds 2``
runs every mode twice, the second time in reverse order (tok/s averaged, TTFTs pooled): on a
shared machine one round's order alone can swing the ratio by 1.5x. It writes its own section of
RESULTS.md.

    python benches/bench_engine.py --preemption-modes recompute,recompute+host,auto --rounds 2 \
        --num-requests 24 --max-output 192 --kv-mib 48 --host-mib 256 --max-model-len 1024
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
from _results import add_write_flag, md_table, write_section  # noqa: E402

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
    kv_cache_dtype: str = "auto",
    **kv_args: Any,
) -> dict:
    """pagedkv on `requests`; `kv_args`: kv_cache_memory / num_blocks / gpu_memory_utilization.
    Besides the throughput keys, the result holds each request's output token ids (`outputs`),
    the peak KV blocks used and running sequences, and the pool's dtype."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(
        model,
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        kv_cache_dtype=kv_cache_dtype,
        **kv_args,
    )
    engine = llm.llm_engine
    for i, (ids, n) in enumerate(requests):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    peak_blocks = peak_running = produced = 0
    peak_host_blocks = 0
    outputs: dict[str, list[int]] = {}
    ttfts: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                produced += len(o.outputs[0].token_ids)
                outputs[o.request_id] = list(o.outputs[0].token_ids)
                if o.metrics is not None and o.metrics.time_to_first_token is not None:
                    ttfts.append(o.metrics.time_to_first_token)
        sched = engine.scheduler.stats()
        peak_blocks = max(peak_blocks, sched.num_used_blocks)
        peak_running = max(peak_running, sched.num_running)
        peak_host_blocks = max(peak_host_blocks, sched.num_host_used_blocks)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    runner = engine.runner
    kv_note = "" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} KV"
    return {
        "name": f"pagedkv LLM ({runner.attention_backend} attention{kv_note})",
        "tokens": produced,
        "seconds": elapsed,
        "peak_kv_bytes": peak_blocks * runner.bytes_per_block,
        "num_blocks": runner.num_blocks,
        "bytes_per_block": runner.bytes_per_block,
        "block_size": runner.block_size,
        "peak_blocks": peak_blocks,
        "peak_running": peak_running,
        "preemptions": stats["num_preemptions"],
        "kv_cache_dtype": stats["kv_cache_dtype"],
        "kv_bytes_per_token": stats["kv_bytes_per_token"],
        "kv_cache_bytes": stats["kv_cache_bytes"],
        "model_time_s": stats.get("model_time_s"),
        "outputs": outputs,
        "ttfts": ttfts,
        "peak_host_blocks": peak_host_blocks,
        "stats": stats,
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


KV_SECTION = "Engine: int8 KV vs auto, same requests (issue 10)"


def compare_kv_dtypes(args: argparse.Namespace, requests: Requests, dtypes: list[str], budgets_mib: list[int]) -> None:
    """pagedkv once per (KV budget, KV dtype) on the same requests; one table, own section."""
    rows: list[list[object]] = []
    verdicts: list[str] = []
    for mib in budgets_mib:
        first: dict | None = None
        for dtype in dtypes:
            print(f"pagedkv, {mib} MiB KV, kv_cache_dtype={dtype} ...", flush=True)
            r = run_pagedkv(
                requests,
                kv_cache_memory=mib << 20,
                max_num_seqs=args.max_num_seqs,
                budget=args.budget,
                kv_cache_dtype=dtype,
            )
            tps = r["tokens"] / r["seconds"]
            if first is None:
                first = r
            base_tps = first["tokens"] / first["seconds"]
            same = sum(r["outputs"][k] == first["outputs"][k] for k in first["outputs"])
            prefix = []
            for k, ref in first["outputs"].items():
                got = r["outputs"][k]
                n = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                prefix.append(n / max(1, len(ref)))
            rows.append(
                [
                    mib,
                    f"{dtype} ({r['kv_cache_dtype']})",
                    r["kv_bytes_per_token"],
                    f"{r['num_blocks']} x {r['block_size']}",
                    r["num_blocks"] * r["block_size"],
                    r["peak_blocks"],
                    r["peak_blocks"] * r["bytes_per_block"] / 2**20,
                    r["peak_running"],
                    r["preemptions"],
                    r["tokens"],
                    r["seconds"],
                    tps,
                    f"{tps / base_tps:.2f}x",
                    f"{same}/{len(first['outputs'])} ({100 * sum(prefix) / max(1, len(prefix)):.0f}%)",
                ]
            )
            if r is not first:
                verdicts.append(
                    f"{mib} MiB: {dtype} {tps:.1f} vs {dtypes[0]} {base_tps:.1f} output tok/s ({tps / base_tps:.2f}x); "
                    f"pool {r['num_blocks'] / first['num_blocks']:.2f}x the blocks; preemptions "
                    f"{first['preemptions']} -> {r['preemptions']}; peak running {first['peak_running']} -> "
                    f"{r['peak_running']}."
                )
    table = md_table(
        [
            "KV MiB",
            "kv_cache_dtype",
            "KV bytes/token",
            "pool blocks",
            "pool tokens",
            "peak blocks used",
            "peak KV MiB",
            "peak running seqs",
            "preemptions",
            "output tokens",
            "seconds",
            "output tok/s",
            f"vs {dtypes[0]}",
            f"outputs equal to {dtypes[0]} (mean agreeing prefix)",
        ],
        rows,
    )
    cap = "uncapped" if args.max_output >= 2048 else f"capped at {args.max_output}"
    desc = (
        f"pagedkv LLM only, once per KV budget and kv_cache_dtype, one after the other in one process, on the same "
        f"{len(requests)} ShareGPT first turns (prompt <= {args.max_prompt} tokens, prompt + output <= 2048, recorded "
        f"output lengths {cap}; {sum(len(i) for i, _ in requests)} prompt / {sum(n for _, n in requests)} output "
        f"tokens), greedy, eos ignored, max_num_seqs {args.max_num_seqs}, budget {args.budget} tokens per step; "
        f"SmolLM2-135M-Instruct float32, CPU attention backend (Rust decode kernel; int8 reads the quantized blocks "
        f"and their bfloat16 scales); torch {torch.__version__}, {torch.get_num_threads()} threads. The pool is "
        f"kv_cache_memory / (bytes per token x 16); peak = the most blocks in use at any step. 'Outputs equal': "
        f"requests whose greedy output is token for token the {dtypes[0]} one; the agreeing prefix is the share of "
        f"each output before its first differing token, averaged."
    )
    print(desc)
    print(table)
    verdict = "\n".join(verdicts)
    print(verdict)
    if not args.no_write:
        cmd = "python benches/bench_engine.py " + " ".join(sys.argv[1:])
        write_section(KV_SECTION, cmd.strip(), desc + "\n\n" + table + "\n\n" + verdict)


MODES_SECTION = "Engine: swap vs recompute preemption, same requests (issue 11)"


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation; nan when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mode_engine_args(mode: str, host_mib: int) -> dict[str, Any]:
    """EngineArgs of one --preemption-modes entry: recompute (no host tier), recompute+host,
    swap, auto (a host tier of host_mib MiB)."""
    if mode == "recompute":
        return {"preemption_mode": "recompute"}
    base = mode.removesuffix("+host")
    if base not in ("recompute", "swap", "auto") or (mode.endswith("+host") and base != "recompute"):
        raise SystemExit(f"unknown preemption mode {mode!r}: use recompute, recompute+host, swap, auto")
    return {"preemption_mode": base, "host_kv_cache_memory": host_mib << 20}


def compare_preemption_modes(args: argparse.Namespace, requests: Requests, modes: list[str]) -> None:
    """pagedkv once per preemption mode on the same requests and KV pool; one table, own section."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for rnd in range(args.rounds):
        # Odd rounds run the modes in reverse order, so a machine that gets busier or quieter
        # during the run (or a first-run warm-up) does not favour one mode.
        order = modes if rnd % 2 == 0 else modes[::-1]
        for mode in order:
            engine_args = mode_engine_args(mode, args.host_mib)
            print(
                f"round {rnd + 1}/{args.rounds}: pagedkv, {args.kv_mib} MiB KV, {mode} ({engine_args}) ...", flush=True
            )
            r = run_pagedkv(
                requests,
                kv_cache_memory=args.kv_mib << 20,
                max_num_seqs=args.max_num_seqs,
                budget=args.budget,
                max_model_len=args.max_model_len,
                kv_cache_dtype=args.kv_cache_dtype,
                **engine_args,
            )
            st = r["stats"]
            print(
                f"  {r['tokens'] / r['seconds']:.1f} output tok/s in {r['seconds']:.1f} s; preemptions "
                f"{st['num_preemptions']} ({st['num_swap_preemptions']} swap); tokens computed "
                f"{st['tokens_computed']}",
                flush=True,
            )
            runs[mode].append(r)
    # Per mode: counters and outputs of the first round; tok/s the mean over rounds; TTFTs pooled.
    results: list[tuple[str, dict]] = []
    for mode in modes:
        r = dict(runs[mode][0])
        r["round_tps"] = [x["tokens"] / x["seconds"] for x in runs[mode]]
        r["tps"] = sum(r["round_tps"]) / len(r["round_tps"])
        r["ttfts"] = [t for x in runs[mode] for t in x["ttfts"]]
        results.append((mode, r))
    base_mode, base = results[0]
    base_tps = base["tps"]
    warnings = []
    for mode, r in results:
        if r["preemptions"] == 0 and mode.startswith("recompute"):
            warnings.append(
                f"WARNING: no preemption in the {mode} run ({r['num_blocks']} blocks): lower --kv-mib or raise "
                f"--num-requests / --max-output, or the modes are not compared at all."
            )
    for w in warnings:
        print(w, file=sys.stderr)
    rows: list[list[object]] = []
    for mode, r in results:
        st = r["stats"]
        tps = r["tps"]
        ttft = r["ttfts"]
        same = sum(r["outputs"][k] == base["outputs"][k] for k in base["outputs"])
        swaps = st["num_swap_preemptions"]
        rows.append(
            [
                mode,
                "-"
                if not st["num_host_blocks"]
                else f"{st['num_host_blocks']} ({st['host_kv_cache_bytes'] / 2**20:.0f})",
                r["tokens"],
                " / ".join(f"{x['seconds']:.0f}" for x in runs[mode]),
                " / ".join(f"{t:.1f}" for t in r["round_tps"]),
                tps,
                f"{tps / base_tps:.2f}x",
                sum(ttft) / max(1, len(ttft)),
                _percentile(ttft, 0.5),
                _percentile(ttft, 0.9),
                f"{swaps} / {st['num_preemptions'] - swaps}",
                st["tokens_computed"],
                f"{st['bytes_swapped_out'] / 2**20:.1f} / {st['bytes_swapped_in'] / 2**20:.1f}",
                st["num_write_backs"],
                st["prefix_cache_host_hits"],
                r["peak_running"],
                f"{same}/{len(base['outputs'])}",
            ]
        )
    table = md_table(
        [
            "mode",
            "host blocks (MiB)",
            "output tokens",
            "seconds per round",
            "output tok/s per round",
            "output tok/s (mean)",
            f"vs {base_mode}",
            "TTFT mean s",
            "TTFT p50 s",
            "TTFT p90 s",
            "preemptions swap / recompute",
            "tokens computed",
            "MiB swapped out / in",
            "write-backs",
            "host prefix hit tokens",
            "peak running",
            f"outputs equal to {base_mode}",
        ],
        rows,
    )
    first_host = next((r for _, r in results if r["stats"]["swap_bandwidth_bytes_per_s"]), None)
    bw = ""
    if first_host is not None:
        st = first_host["stats"]
        bw = (
            f" Swap bandwidth measured at engine start (round trip through HostKVCache.swap): "
            f"{st['swap_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; the forward's measured recompute rate "
            f"{st['recompute_tokens_per_s'] or float('nan'):.0f} tokens/s; one block = {first_host['bytes_per_block']:,} "
            f"bytes."
        )
    cap = "uncapped" if args.max_output >= 2048 else f"capped at {args.max_output}"
    desc = (
        f"pagedkv LLM only, once per preemption mode and round ({args.rounds} round(s), odd rounds in reverse mode "
        f"order), one after the other in one process, on the same "
        f"{len(requests)} ShareGPT first turns (prompt <= {args.max_prompt} tokens, prompt + output <= "
        f"{args.max_model_len}, recorded output lengths {cap}; {sum(len(i) for i, _ in requests)} prompt / "
        f"{sum(n for _, n in requests)} output tokens), all arriving at t=0, greedy, eos ignored, max_num_seqs "
        f"{args.max_num_seqs}, budget {args.budget} tokens per step, max_model_len {args.max_model_len}; KV pool "
        f"{args.kv_mib} MiB ({base['num_blocks']} blocks x {base['block_size']}, kv_cache_dtype "
        f"{base['kv_cache_dtype']}), host tier {args.host_mib} MiB for the modes that have one; "
        f"SmolLM2-135M-Instruct float32, CPU attention backend; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads. recompute = no host tier (the engine before the offload tier); "
        f"recompute+host = recompute with the host tier (write-backs of evicted cached blocks, host prefix hits). "
        f"Output tok/s: the mean over rounds; TTFT = first token time - arrival (add_request), so it includes "
        f"queueing, pooled over rounds; the other columns from the first round. Tokens computed = tokens through the "
        f"forward (prompts, recomputed tokens, decodes).{bw}"
    )
    print(desc)
    print(table)
    verdicts = []
    for mode, r in results[1:]:
        tps = r["tps"]
        verdicts.append(
            f"{mode} / {base_mode}: {tps / base_tps:.2f}x output tok/s ({tps:.1f} vs {base_tps:.1f}); tokens computed "
            f"{base['stats']['tokens_computed']} -> {r['stats']['tokens_computed']}; TTFT p50 "
            f"{_percentile(base['ttfts'], 0.5):.1f} -> {_percentile(r['ttfts'], 0.5):.1f} s."
        )
    verdict = "\n".join(warnings + verdicts)
    print(verdict)
    if not args.no_write:
        cmd = "python benches/bench_engine.py " + " ".join(sys.argv[1:])
        write_section(MODES_SECTION, cmd.strip(), desc + "\n\n" + table + "\n\n" + verdict)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=2048, help="cap on recorded output lengths (2048: none)")
    ap.add_argument("--kv-mib", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--static-batch", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", default="auto", help="pagedkv's kv_cache_dtype: auto, int8, fp8, fp8_e5m2")
    ap.add_argument(
        "--kv-dtypes",
        default=None,
        help="comma-separated kv_cache_dtypes, e.g. auto,int8: run only pagedkv, once per dtype, same requests",
    )
    ap.add_argument("--compare-kv-mib", default=None, help="with --kv-dtypes: comma-separated KV budgets (MiB)")
    ap.add_argument(
        "--preemption-modes",
        default=None,
        help="comma-separated preemption modes (recompute, recompute+host, swap, auto), e.g. recompute,auto,swap: "
        "run only pagedkv, once per mode, same requests, KV pool of --kv-mib",
    )
    ap.add_argument("--host-mib", type=int, default=256, help="with --preemption-modes: host KV tier MiB")
    ap.add_argument("--max-model-len", type=int, default=2048, help="with --preemption-modes: max_model_len")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --preemption-modes: run every mode this many times (odd rounds in reverse order); tok/s averaged",
    )
    ap.add_argument("--quick", action="store_true", help="8 short requests (smoke run)")
    add_write_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.max_output, args.no_write = 8, 16, True
    requests = load_requests(args.num_requests, args.max_prompt, args.max_output, args.max_model_len)
    if args.preemption_modes:
        modes = [m.strip() for m in args.preemption_modes.split(",") if m.strip()]
        compare_preemption_modes(args, requests, modes)
        return
    if args.kv_dtypes:
        dtypes = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]
        budgets = [int(m) for m in (args.compare_kv_mib or str(args.kv_mib)).split(",") if m.strip()]
        compare_kv_dtypes(args, requests, dtypes, budgets)
        return
    kv = args.kv_mib << 20
    results = [
        run_pagedkv(
            requests,
            kv_cache_memory=kv,
            max_num_seqs=args.max_num_seqs,
            budget=args.budget,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    ]
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
        f"tokens), greedy, eos ignored; SmolLM2-135M-Instruct float32, CPU; pagedkv kv_cache_dtype "
        f"{args.kv_cache_dtype}; torch {torch.__version__}, "
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
        section = "Engine: CPU throughput vs transformers (issue 5)"
        if args.kv_cache_dtype != "auto":
            section += f", {args.kv_cache_dtype} KV"
        write_section(section, cmd.strip(), desc + "\n\n" + table + "\n" + verdict)


if __name__ == "__main__":
    main()
