"""Sampling cost for every setting: the sampler alone, and the decode step of
an LLMEngine whose model is nearly free, so that the step is host work (the sampler's share
shows). Target: every setting <= 2x the greedy step; with penalties and a logit_bias on every
row <= 1.3x.

1. Sampler alone: rows {1, 32, 256} x vocab {32000, 49152, 151936} x settings (greedy,
   temperature, top-k, top-p on peaked and on flat rows, min-p, top-k + top-p, logprobs; plus
   two stress settings: top-k 1000 and top-p 0.3 on flat rows). Median ms per call (metadata
   build included), ratio to greedy measured in the same interleaved loop, and the sampler of
   commit 0a35374 (sort-based top-p; loaded from git) side by side.
2. Engine step: a 1-layer random-weight model with SmolLM2-135M's config and tokenizer, 256
   running requests, decode steps timed per setting (settings interleaved over several rounds;
   the ratio to greedy is the median of per-round ratios), and the engine's sampling call
   (`SamplingMetadata.build` + `Sampler`) timed inside those steps. The old sampler runs in the
   same engine (swapped in) for comparison. On a slow-matmul CPU the LM head (256 x 576 x
   49152) dominates the step; the sampling column is the host work this issue is about.

    python benches/bench_sampler.py [--quick] [--write] [--skip-old] [--skip-engine]

`--quick` is a smoke run on tiny shapes (a 1024-token vocab, a tiny model); it never writes
RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import add_write_flag, md_table, write_section

from pagedkv.sample import sampler as new_sampler
from pagedkv.sample.sampling_params import SamplingParams

# The last commit whose sampler sorted for top-p (and allocated a fresh [S, V] per pass).
OLD_COMMIT = "0a35374f35e7ca668b366adf5e4b80711513bce1"

# (name, SamplingParams kwargs, logits kind). The first is the baseline of every ratio.
SETTINGS: list[tuple[str, dict[str, Any], str]] = [
    ("greedy", {"temperature": 0.0}, "peaked"),
    ("temperature 0.8", {"temperature": 0.8}, "peaked"),
    ("top_k 50", {"temperature": 0.8, "top_k": 50}, "peaked"),
    ("top_p 0.95", {"temperature": 0.8, "top_p": 0.95}, "peaked"),
    ("top_p 0.95, flat rows", {"temperature": 1.0, "top_p": 0.95}, "flat"),
    ("min_p 0.05", {"temperature": 0.8, "min_p": 0.05}, "peaked"),
    ("top_k 50 + top_p 0.95", {"temperature": 0.8, "top_k": 50, "top_p": 0.95}, "peaked"),
    ("logprobs 5", {"temperature": 0.8, "logprobs": 5}, "peaked"),
]
# Penalties: presence, frequency and repetition penalties and a logit_bias on every row (greedy,
# so the ratio to greedy is the penalties' own cost). The old sampler has none: not timed.
PENALTIES_KW: dict[str, Any] = {
    "temperature": 0.0,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "logit_bias": {token: 2.0 for token in range(0, 1000, 100)},
}
PENALTIES = "penalties + logit_bias (greedy)"
SETTINGS.append((PENALTIES, PENALTIES_KW, "peaked"))
# Sampler alone: each row's history for the penalties (prompt, output tokens).
HISTORY = (256, 64)
STRESS: list[tuple[str, dict[str, Any], str]] = [
    ("stress: top_k 1000", {"temperature": 0.8, "top_k": 1000}, "peaked"),
    ("stress: top_p 0.3, flat rows", {"temperature": 1.0, "top_p": 0.3}, "flat"),
]
ENGINE_SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("greedy", {"temperature": 0.0}),
    ("temperature 0.8", {"temperature": 0.8}),
    ("top_p 0.95", {"temperature": 0.8, "top_p": 0.95}),
    ("top_k 50", {"temperature": 0.8, "top_k": 50}),
    ("min_p 0.05", {"temperature": 0.8, "min_p": 0.05}),
    ("seeded (temperature 0.8, top_p 0.95)", {"temperature": 0.8, "top_p": 0.95, "seed": 1234}),
    (PENALTIES, PENALTIES_KW),
]


def load_old_sampler() -> ModuleType | None:
    """The sampler module of OLD_COMMIT, imported under another name (None without git)."""
    try:
        source = subprocess.run(
            ["git", "show", f"{OLD_COMMIT}:python/pagedkv/sample/sampler.py"],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp(prefix="old_sampler_")) / "pagedkv_old_sampler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("pagedkv_old_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pagedkv_old_sampler"] = module
    spec.loader.exec_module(module)
    return module


def make_logits(rows: int, vocab: int, kind: str, seed: int = 0) -> torch.Tensor:
    """peaked: a standard-normal bulk plus 8 tokens per row 14-18 above it (the 0.95 nucleus
    is a handful of tokens, as for a confident model); flat: normal with scale 0.5 (the nucleus
    is ~90% of the vocabulary, as at high temperature or for a random model)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(rows, vocab, generator=generator) * 0.5
    logits = torch.randn(rows, vocab, generator=generator)
    top = torch.randint(0, vocab, (rows, 8), generator=generator)
    logits.scatter_(1, top, 14.0 + 4.0 * torch.rand(rows, 8, generator=generator))
    return logits


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def bench_sampler_alone(
    rows_list: list[int],
    vocabs: list[int],
    settings: list[tuple[str, dict[str, Any], str]],
    repeats: int,
    old: ModuleType | None,
) -> tuple[list[list[object]], list[list[object]]]:
    """Returns (result rows, metadata-build rows)."""
    table: list[list[object]] = []
    build_rows: list[list[object]] = []
    for vocab in vocabs:
        for rows in rows_list:
            logits = {kind: make_logits(rows, vocab, kind) for kind in ("peaked", "flat")}
            params = {name: [SamplingParams(**kw)] * rows for name, kw, _ in settings}
            generator = torch.Generator().manual_seed(2)
            history = {
                f"{part}_token_ids": [
                    torch.randint(0, vocab, (length,), generator=generator).numpy() for _ in range(rows)
                ]
                for part, length in zip(("prompt", "output"), HISTORY)
            }
            samplers = {"new": (new_sampler, new_sampler.Sampler())}
            if old is not None:
                samplers["old"] = (old, old.Sampler())
            times: dict[tuple[str, str], list[float]] = {}
            builds: list[float] = []
            skip_old: set[str] = set()
            for rep in range(repeats + 1):  # the first round warms up (workspace, caches)
                for name, _, kind in settings:
                    for label, (module, sampler) in samplers.items():
                        if label == "old" and (name in skip_old or name == PENALTIES):
                            continue
                        extra = history if name == PENALTIES else {}
                        start = time.perf_counter()
                        metadata = module.SamplingMetadata.build(params[name], vocab_size=vocab, **extra)
                        built = time.perf_counter()
                        sampler(logits[kind], metadata)
                        elapsed = time.perf_counter() - start
                        if rep == 0:
                            # The old sort path takes seconds at 256 x 152k: time it 3 times.
                            if label == "old" and elapsed > 0.3 and repeats > 3:
                                skip_old.add(name)
                                times[(label, name)] = [elapsed] + [
                                    _time_once(module, sampler, params[name], vocab, logits[kind]) for _ in range(2)
                                ]
                            continue
                        times.setdefault((label, name), []).append(elapsed)
                        if label == "new" and name == "top_p 0.95":
                            builds.append(built - start)
            greedy = _median_ms(times[("new", "greedy")])
            for name, _, _ in settings:
                new_ms = _median_ms(times[("new", name)])
                row: list[object] = [rows, vocab, name, new_ms, new_ms / greedy]
                if old is not None and ("old", name) in times:
                    old_ms = _median_ms(times[("old", name)])
                    row += [old_ms, old_ms / new_ms]
                elif old is not None:
                    row += ["-", "-"]
                table.append(row)
            if builds:  # timed on the top_p setting, when it is among the settings
                build_rows.append([rows, vocab, _median_ms(builds) * 1e3])
            print(f"  sampler alone: {rows} rows x {vocab} done", flush=True)
    return table, build_rows


def _time_once(
    module: ModuleType, sampler: Any, params: list[SamplingParams], vocab: int, logits: torch.Tensor
) -> float:
    start = time.perf_counter()
    sampler(logits, module.SamplingMetadata.build(params, vocab_size=vocab))
    return time.perf_counter() - start


# ------------------------------------------------------------------------------- engine step


def build_model(folder: Path, quick: bool) -> dict[str, int]:
    """SmolLM2-135M's config with one layer and random weights (+ its tokenizer) in `folder`.
    `quick`: a tiny hidden size and a 1024-token vocab."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedkv.worker.model_files import default_model_dir

    source = Path(default_model_dir())
    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = 1
    if quick:
        config.vocab_size = 1024
        config.hidden_size = 64
        config.intermediate_size = 128
        config.num_attention_heads = 4
        config.num_key_value_heads = 2
        if hasattr(config, "head_dim"):
            config.head_dim = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    for path in source.iterdir():
        if (
            path.is_file()
            and path.name != "config.json"
            and not path.name.endswith(".safetensors")
            and path.name != "pagedkv_conversion.json"
            and not (folder / path.name).exists()
        ):
            shutil.copy(path, folder / path.name)
    return {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size}


@contextlib.contextmanager
def old_sampler_in(engine: Any, old: ModuleType) -> Iterator[None]:
    """The engine samples with the old module for the duration."""
    from pagedkv.sample import metadata

    saved = engine.sampler, metadata.SamplingMetadata
    engine.sampler, metadata.SamplingMetadata = old.Sampler(), old.SamplingMetadata
    try:
        yield
    finally:
        engine.sampler, metadata.SamplingMetadata = saved


def set_params(engine: Any, kwargs: dict[str, Any], max_tokens: int) -> None:
    """Every running request samples with `kwargs` from the next step on (seeded: a fresh
    generator per sample, as a request with that seed would have)."""
    from pagedkv.sample.sampler import make_generator

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)
    for state in engine.requests.values():
        state.params = params
        for sample in state.samples:
            sample.generator = None if params.seed is None else make_generator(params.seed + sample.index)


def bench_engine(
    quick: bool,
    old: ModuleType | None,
    rounds: int,
    steps_per_round: int,
    num_seqs: int,
    engine_settings: list[tuple[str, dict[str, Any]]] = ENGINE_SETTINGS,
) -> tuple[list[list[object]], str]:
    import pagedkv

    folder = Path(tempfile.mkdtemp(prefix="bench_sampler_model_"))
    try:
        info = build_model(folder, quick)
        prompt_len = 8
        total_steps = (rounds + 1) * len(engine_settings) * steps_per_round * (2 if old is not None else 1)
        max_model_len = ((prompt_len + total_steps + 64) // 16 + 1) * 16
        engine = pagedkv.LLMEngine(
            model=str(folder),
            dtype="float32",
            device="cpu",
            max_model_len=max_model_len,
            num_blocks=num_seqs * (max_model_len // 16 + 1),
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(2048, num_seqs * prompt_len),
        )
        generator = torch.Generator().manual_seed(1)
        max_tokens = max_model_len - prompt_len
        for i in range(num_seqs):
            ids = torch.randint(0, info["vocab_size"], (prompt_len,), generator=generator).tolist()
            engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        while engine.scheduler.num_waiting > 0 or engine.get_num_unfinished_requests() < num_seqs:
            engine.step()
        engine.step()  # every request is decoding from here on

        # The engine's own sampling call (metadata build + sampler), timed inside each step.
        sample_times: list[float] = []
        sample = engine._sample

        def timed_sample(*args: Any) -> Any:
            start = time.perf_counter()
            result = sample(*args)
            sample_times.append(time.perf_counter() - start)
            return result

        engine._sample = timed_sample
        variants = [("new", contextlib.nullcontext)]
        if old is not None:
            variants.append(("old", lambda: old_sampler_in(engine, old)))
        times: dict[tuple[str, str], list[list[float]]] = {}
        sampling: dict[tuple[str, str], list[float]] = {}
        for round_ in range(rounds + 1):  # round 0 warms up every setting and is dropped
            for label, context in variants:
                with context():
                    for name, kwargs in engine_settings:
                        if label == "old" and name == PENALTIES:
                            continue
                        set_params(engine, kwargs, max_tokens)
                        samples = []
                        for _ in range(steps_per_round):
                            start = time.perf_counter()
                            engine.step()
                            samples.append(time.perf_counter() - start)
                        if round_:
                            times.setdefault((label, name), []).append(samples)
                            sampling.setdefault((label, name), []).extend(sample_times[-steps_per_round:])
        assert engine.get_num_unfinished_requests() == num_seqs
        table: list[list[object]] = []
        for name, _ in engine_settings:
            row: list[object] = [name]
            for label, _ in variants:
                if (label, name) not in times:
                    row += ["-", "-", "-"]
                    continue
                per_round = [statistics.median(r) for r in times[(label, name)]]
                greedy_rounds = [statistics.median(r) for r in times[(label, "greedy")]]
                ratio = statistics.median(t / g for t, g in zip(per_round, greedy_rounds))
                row += [statistics.median(per_round) * 1e3, statistics.median(sampling[(label, name)]) * 1e3, ratio]
            table.append(row)
        desc = (
            f"1-layer random-weight model with SmolLM2-135M's config (vocab {info['vocab_size']}, hidden "
            f"{info['hidden_size']}), float32 on the CPU, {num_seqs} running requests (8-token prompts, all "
            f"decoding), {rounds} rounds x {steps_per_round} timed steps per setting, settings interleaved "
            f"(after a warm-up round); step ms: median over rounds; sampling ms: the engine's `_sample` "
            f"(SamplingMetadata.build + Sampler) inside those steps; x greedy: median over rounds of "
            f"(setting / greedy in the same round)."
        )
        return table, desc
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def penalties_only(no_write: bool) -> None:
    """The figure: one decode step of 256 rows with presence, frequency and repetition
    penalties and a logit_bias on every row against a greedy step (target <= 1.3x), and the
    sampler alone at the same shapes."""
    settings = [s for s in SETTINGS if s[0] in ("greedy", PENALTIES)]
    alone, _ = bench_sampler_alone([1, 32, 256], [49152, 151936], settings, 15, None)
    alone_table = md_table(["rows", "vocab", "setting", "ms (median)", "x greedy"], alone)
    print(alone_table)
    engine_settings = [s for s in ENGINE_SETTINGS if s[0] in ("greedy", PENALTIES)]
    rows, desc = bench_engine(False, None, 12, 2, 256, engine_settings)
    engine_table = md_table(["setting", "step ms", "sampling ms", "x greedy"], rows)
    print(desc)
    print(engine_table)
    penalties = next(r for r in rows if r[0] == PENALTIES)
    met = "met" if penalties[3] <= 1.3 else "NOT met"
    verdict = (
        f"Penalties + logit_bias on every row: the decode step at {penalties[3]:.2f}x greedy (target <= 1.3x: "
        f"{met}), sampling {penalties[2]:.1f} ms of its step."
    )
    print(verdict)
    if not no_write:
        body = (
            f"Penalties: presence 0.5, frequency 0.5, repetition 1.2 and a 10-token logit_bias on every row "
            f"(greedy); sampler alone: each row with a {HISTORY[0]}-token prompt and {HISTORY[1]} output tokens "
            f"(median ms per call, metadata build included):\n\n{alone_table}\n\n{desc}\n\n{engine_table}\n\n{verdict}\n"
        )
        write_section(
            "Sampler: penalties and logit_bias (issue 26)", "python benches/bench_sampler.py --penalties-only", body
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke run); never writes RESULTS.md")
    add_write_flag(ap)
    ap.add_argument("--skip-old", action="store_true", help="do not time the old sampler")
    ap.add_argument("--skip-engine", action="store_true", help="sampler alone only")
    ap.add_argument(
        "--penalties-only",
        action="store_true",
        help="greedy vs penalties + logit_bias only (issue 26's figure; its own RESULTS.md section)",
    )
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.penalties_only:
        penalties_only(args.no_write)
        return

    old = None if args.skip_old else load_old_sampler()
    if old is None and not args.skip_old:
        print(f"(old sampler unavailable: git show {OLD_COMMIT[:7]} failed)")
    if args.quick:
        rows_list, vocabs, repeats, settings = [1, 8], [1024], 3, SETTINGS + STRESS
        rounds, steps, num_seqs = 2, 2, 8
    else:
        rows_list, vocabs, repeats, settings = [1, 32, 256], [32000, 49152, 151936], 15, SETTINGS + STRESS
        rounds, steps, num_seqs = 12, 2, 256

    print("Sampler alone ...", flush=True)
    alone, builds = bench_sampler_alone(rows_list, vocabs, settings, repeats, old)
    headers = ["rows", "vocab", "setting", "ms (median)", "x greedy"]
    if old is not None:
        headers += [f"old ms ({OLD_COMMIT[:7]})", "old / new"]
    alone_table = md_table(headers, alone)
    print(alone_table)
    build_table = md_table(["rows", "vocab", "SamplingMetadata.build us (top_p rows)"], builds)
    print(build_table)
    worst = max((r for r in alone if r[0] == max(rows_list) and not str(r[2]).startswith("stress")), key=lambda r: r[4])
    print(f"\nworst setting at {worst[0]} rows: {worst[2]} at {worst[1]} tokens, {worst[4]:.2f}x greedy")

    engine_table = engine_desc = ""
    verdict = ""
    if not args.skip_engine:
        print("\nEngine step ...", flush=True)
        rows, engine_desc = bench_engine(args.quick, old, rounds, steps, num_seqs)
        headers = ["setting", "step ms", "sampling ms", "x greedy"]
        if old is not None:
            headers += ["old sampler: step ms", "old: sampling ms", "old: x greedy"]
        engine_table = md_table(headers, rows)
        print(engine_desc)
        print(engine_table)
        worst_engine = max(rows, key=lambda r: r[3])
        met = "met" if worst_engine[3] <= 2.0 else "NOT met"
        verdict = (
            f"\nEngine step: worst setting {worst_engine[0]} at {worst_engine[3]:.2f}x greedy "
            f"(target <= 2x: {met}); sampling {worst_engine[2]:.1f} ms of its step."
        )
        penalties = next(r for r in rows if r[0] == PENALTIES)
        met = "met" if penalties[3] <= 1.3 else "NOT met"
        verdict += (
            f"\nPenalties + logit_bias on every row (issue 26): {penalties[3]:.2f}x greedy (target <= 1.3x: {met}), "
            f"sampling {penalties[2]:.1f} ms of its step."
        )
        if old is not None:
            old_worst = max((r for r in rows if r[0] != PENALTIES), key=lambda r: r[6])
            verdict += (
                f" Old sampler: worst {old_worst[0]} at {old_worst[6]:.2f}x greedy, sampling {old_worst[5]:.0f} ms."
            )
        print(verdict)

    if not args.no_write and not args.quick:
        body = (
            "Sampler alone (median ms per call, SamplingMetadata.build included; ratio to greedy in the same "
            "interleaved loop; peaked rows: 8 tokens 14-18 above a normal bulk, flat rows: normal, scale 0.5):\n\n"
            + alone_table
            + "\n\n"
            + build_table
            + "\n"
        )
        if engine_table:
            body += "\n" + engine_desc + "\n\n" + engine_table + "\n" + verdict + "\n"
        write_section("Sampler: cost per setting (issue 9)", "python benches/bench_sampler.py", body)


if __name__ == "__main__":
    main()
