"""GGUF block linears on the CPU: SmolLM2-135M's linears with float32 weights (torch's
product and pagedkv's kernel), int8 weights (pagedkv's kernel, ``quantization="int8"``) and
GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K; ``rust/cpu_linear_gguf``), and the engine's decode steps
with the embedded SmolLM2 served as float32, int8 and from its own Q4_1 blocks.

Linears: every decoder linear of SmolLM2's 30 layers (q, k, v, o 576 wide; gate, up 576 -> 1536;
down 1536 -> 576: 134M weights) as separate weights (so a pass reads them from memory, not
cache), one pass = each linear once on M input rows; the best of ``--repeats`` passes, in ms,
and the weight bytes read per second. Q4_K's blocks are 256 values wide, which 576 is not, so
it has its own rows over the 30 down projections only, beside the other formats on them.
Weights are random (the kernels' speed does not depend on the values).

Engine: the same requests through one engine per variant in one process, their steps
interleaved one for one (benches/bench_kv_groups_engine.py's ``interleaved_round``): output
tokens per second of each engine's own step time, at batch 1 and 16.

    python benches/bench_gguf_linear.py                # linears and engine
    python benches/bench_gguf_linear.py --no-engine    # linears only
    python benches/bench_gguf_linear.py --quick        # a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import md_table  # noqa: E402

from pagedkv import LLM, _core  # noqa: E402
from pagedkv.worker.gguf_linear import GGUF_BLOCK_FORMATS  # noqa: E402

HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30
LAYER_SHAPES = [  # (N, K) of one decoder layer's linears
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
]


def _random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    values, nbytes = GGUF_BLOCK_FORMATS[kind]
    raw = rng.integers(0, 256, (n, k // values, nbytes), dtype=np.uint8)
    halves = 2 if kind in ("Q4_1", "Q4_K") else 1
    scales = rng.uniform(1e-3, 5e-2, (n, k // values, halves)).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(n, k // values, 2 * halves)
    return raw.reshape(n, -1)


def _weights(fmt: str, shapes: list[tuple[int, int]], rng: np.random.Generator) -> list[tuple[object, ...]]:
    """Per linear, what its call needs: (weight array, scales or kind)."""
    out: list[tuple[object, ...]] = []
    for n, k in shapes:
        if fmt.startswith("float32"):
            out.append((torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) * 0.05),))
        elif fmt == "int8":
            codes = rng.integers(-127, 128, (n, k), dtype=np.int8)
            out.append((codes, rng.uniform(1e-3, 1e-2, n).astype(np.float32)))
        else:
            out.append((_random_blocks(fmt, n, k, rng), fmt))
    return out


def _bytes(fmt: str, shapes: list[tuple[int, int]]) -> int:
    total = 0
    for n, k in shapes:
        if fmt.startswith("float32"):
            total += 4 * n * k
        elif fmt == "int8":
            total += n * k + 4 * n
        else:
            values, nbytes = GGUF_BLOCK_FORMATS[fmt]
            total += n * (k // values) * nbytes
    return total


def _pass(fmt: str, weights: list[tuple[object, ...]], rows: int, isa: str) -> Callable[[], None]:
    threads = torch.get_num_threads()
    xs = {k: np.random.default_rng(k).standard_normal((rows, k), dtype=np.float32) for k in (HIDDEN, INTERMEDIATE)}
    calls: list[Callable[[], None]] = []
    for w in weights:
        if fmt == "float32 torch":
            weight = w[0]
            assert isinstance(weight, torch.Tensor)
            x = torch.from_numpy(xs[weight.shape[1]])
            calls.append(lambda x=x, weight=weight: F.linear(x, weight))
            continue
        arr = w[0].numpy() if isinstance(w[0], torch.Tensor) else w[0]
        assert isinstance(arr, np.ndarray)
        x_np, out = xs[arr.shape[1] if fmt.startswith(("float32", "int8")) else _k(fmt, arr)], None
        out = np.empty((rows, arr.shape[0]), dtype=np.float32)
        if fmt in ("float32 pagedkv", "int8"):
            scales = None if fmt.startswith("float32") else w[1]
            calls.append(
                lambda x_np=x_np, arr=arr, out=out, scales=scales: _core.cpu_linear(
                    x_np, arr, out, threads, scales=scales
                )
            )
        else:
            calls.append(
                lambda x_np=x_np, arr=arr, out=out: _core.cpu_linear_gguf(x_np, arr, fmt, out, threads, isa=isa)
            )

    def run() -> None:
        for call in calls:
            call()

    return run


def _k(kind: str, blocks: np.ndarray) -> int:
    values, nbytes = GGUF_BLOCK_FORMATS[kind]
    return blocks.shape[1] // nbytes * values


def _best(run: Callable[[], None], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def linears(args: argparse.Namespace) -> list[str]:
    rng = np.random.default_rng(0)
    decoder = LAYER_SHAPES * LAYERS
    downs = [(HIDDEN, INTERMEDIATE)] * LAYERS
    isa = args.isa
    sets = [
        ("decoder (210 linears)", decoder, ["float32 torch", "float32 pagedkv", "int8", "Q8_0", "Q4_1", "Q4_0"]),
        (
            "down projections (30)",
            downs,
            ["float32 torch", "float32 pagedkv", "int8", "Q8_0", "Q4_1", "Q4_0", "Q4_K"],
        ),
    ]
    rows_out: list[list[object]] = []
    for label, shapes, formats in sets:
        for fmt in formats:
            weights = _weights(fmt, shapes, rng)
            nbytes = _bytes(fmt, shapes)
            for rows in args.rows:
                seconds = _best(_pass(fmt, weights, rows, isa), args.repeats)
                rows_out.append(
                    [
                        label,
                        fmt,
                        f"M={rows}",
                        f"{nbytes / 1e6:.0f}",
                        f"{1000 * seconds:.2f}",
                        f"{nbytes / seconds / 1e9:.1f}",
                    ]
                )
            del weights
    return [
        f"Linears: one pass over SmolLM2-135M's linears on M input rows, best of {args.repeats}, "
        f"{torch.get_num_threads()} threads; GGUF kernel on {isa}.",
        "",
        md_table(["weights", "format", "rows", "weight MB", "ms / pass", "weight GB/s"], rows_out),
    ]


VARIANTS: dict[str, dict[str, object]] = {
    "float32": {"quantization": "none"},
    "int8": {"quantization": "int8"},
    "gguf Q4_1": {"quantization": "gguf"},
}


def engine(args: argparse.Namespace) -> list[str]:
    from bench_kv_groups_engine import interleaved_round

    rng = np.random.default_rng(0)
    rows: list[list[object]] = []
    for batch in args.batches:
        prompts = [rng.integers(1000, 40_000, args.prompt_len).tolist() for _ in range(batch)]
        llms = {
            name: LLM(max_model_len=args.prompt_len + args.max_tokens + 16, max_num_seqs=batch, **kwargs)  # type: ignore[arg-type]
            for name, kwargs in VARIANTS.items()
        }
        interleaved_round(llms, prompts[:1], 2, next(iter(llms)))  # warm-up
        order = list(llms)
        rounds = [interleaved_round(llms, prompts, args.max_tokens, order[k % len(order)]) for k in range(args.rounds)]
        tokens = batch * args.max_tokens * args.rounds
        ref_wall = sum(r["float32"]["wall"] for r in rounds)
        for name, llm in llms.items():
            wall = sum(r[name]["wall"] for r in rounds)
            rows.append(
                [f"B={batch}", name, f"{tokens / wall:.2f}", f"{1000 * wall / tokens:.1f}", f"{ref_wall / wall:.2f}x"]
            )
            llm.shutdown()
    return [
        f"Engine: SmolLM2-135M (embedded, Q4_1 GGUF), {args.prompt_len} random prompt ids, {args.max_tokens} "
        f"greedy output tokens, eos ignored, steps interleaved, {args.rounds} rounds (prefill included).",
        "",
        md_table(["batch", "weights", "output tok/s", "ms / output token", "vs float32"], rows),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--isa", default="auto", choices=["auto", "portable", "avx2", "avx512"])
    parser.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 repeats, 1 row, batch 1, 4 tokens")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rows, args.batches, args.max_tokens, args.rounds = 2, [1], [1], 4, 1
    lines = linears(args)
    if args.engine:
        lines += ["", *engine(args)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
