"""pagedkv's CPU linear kernel on each instruction-set path this CPU has: a pass over
all of SmolLM2-135M's linears (the 210 decoder linears and the tied head, 538 MB as float32) at
M = 1 and 16 input rows, per path (``portable``, ``avx2``, ``avx512``, ``avx512_bf16``) and
weight format (float32, int8 with per-row scales, bfloat16), against torch's own float32 product
(MKL) and the machine's read bandwidth.

Per (format, path, M): milliseconds per pass (median of the rounds), GB/s of weight bytes read
(the weights' bytes / time: at M = 1 the pass is a stream of the weights), and that as a share
of the read roofline: ``torch.sum`` over a 1 GiB float32 tensor on the same threads,
timed as one more variant. The passes run round-robin (one pass of each variant per round), so
every variant, the roofline's among them, sees the same machine (medians of the rounds); the
inputs are random, the outputs discarded.

    python benches/bench_cpu_isa.py                 # print the table
    python benches/bench_cpu_isa.py --write         # and record it in benches/RESULTS.md
    python benches/bench_cpu_isa.py --quick         # a smoke run (a few layers; never writes)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402

from pagedkv import _core  # noqa: E402
from pagedkv.worker.bf16_linear import bf16_bits  # noqa: E402
from pagedkv.worker.cpu_linear import describe_cpu_kernels  # noqa: E402
from pagedkv.worker.int8_linear import quantize_per_channel  # noqa: E402
from pagedkv.worker.model_files import default_model_dir  # noqa: E402

SECTION = "CPU linear kernel per instruction set"
ROWS = (1, 16)


def smollm2_linears(max_layers: int | None) -> list[torch.Tensor]:
    """SmolLM2-135M's linear weights, float32 [N, K] each: every decoder linear of the first
    ``max_layers`` layers (all when None), then the head (tied to the input embedding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    weights = []
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or name == "lm_head":
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        if max_layers is None or layer < max_layers:
            weights.append(module.weight.detach().contiguous())
    weights.append(model.get_output_embeddings().weight.detach().contiguous())
    return weights


def read_pass(big: torch.Tensor) -> Callable[[], None]:
    """One ``torch.sum`` over ``big``: the read roofline, timed in the same rounds as the kernel."""

    def run() -> None:
        big.sum()

    return run


def kernel_pass(
    weights: list[np.ndarray], scales: list[np.ndarray | None], x: np.ndarray, isa: str, threads: int
) -> Callable[[], None]:
    outs = [np.empty((x.shape[0], w.shape[0]), np.float32) for w in weights]
    # Each linear's input is a row block of its own width (K differs between linears).
    xs = {w.shape[1]: np.ascontiguousarray(x[:, : w.shape[1]]) for w in weights}

    def run() -> None:
        for w, s, out in zip(weights, scales, outs, strict=True):
            _core.cpu_linear(xs[w.shape[1]], w, out, threads, scales=s, isa=isa)

    return run


def torch_pass(weights: list[torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    xs = {w.shape[1]: x[:, : w.shape[1]].contiguous() for w in weights}

    def run() -> None:
        with torch.inference_mode():
            for w in weights:
                F.linear(xs[w.shape[1]], w)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads per product")
    parser.add_argument("--rounds", type=int, default=7, help="passes of every variant (median reported)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 layers, 2 rounds (never writes)")
    add_write_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.no_write = 2, True
    threads = args.threads
    torch.set_num_threads(threads)
    print(describe_cpu_kernels())
    f32 = smollm2_linears(2 if args.quick else None)
    int8 = [quantize_per_channel(w) for w in f32]
    formats: dict[str, tuple[list[np.ndarray], list[np.ndarray | None]]] = {
        "float32": ([w.numpy() for w in f32], [None] * len(f32)),
        "int8": ([q.numpy() for q, _ in int8], [s.numpy() for _, s in int8]),
        "bfloat16": ([bf16_bits(w.bfloat16()) for w in f32], [None] * len(f32)),
    }
    bytes_of = {fmt: sum(w.nbytes + (0 if s is None else s.nbytes) for w, s in zip(*ws)) for fmt, ws in formats.items()}
    paths = _core.cpu_isa()["linear_paths"]
    big = torch.ones(2**28, dtype=torch.float32)  # 1 GiB, the roofline's
    print(f"{len(f32)} linears; weights {bytes_of['float32'] / 1e6:.0f} MB float32")
    rooflines = []
    max_k = max(w.shape[1] for w in f32)
    rng = np.random.default_rng(0)
    rows = []
    for m in ROWS:
        x = rng.standard_normal((m, max_k), dtype=np.float32)
        variants: dict[tuple[str, str], Callable[[], None]] = {
            ("read", "torch.sum"): read_pass(big),
            ("float32", "torch (MKL)"): torch_pass(f32, torch.from_numpy(x)),
        }
        for fmt, (ws, ss) in formats.items():
            for isa in paths:
                if isa == "avx512_bf16" and fmt != "bfloat16":
                    continue  # other weights run avx512 on that path
                variants[(fmt, isa)] = kernel_pass(ws, ss, x, isa, threads)
        for run in variants.values():
            run()  # warm up: the pool's threads, the caches' first touch
        times: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
        for _ in range(args.rounds):
            for key, run in variants.items():
                start = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - start)
        roofline = big.numel() * 4 / statistics.median(times.pop(("read", "torch.sum"))) / 1e9
        rooflines.append(roofline)
        print(f"M={m:2d} read bandwidth (torch.sum over 1 GiB) {roofline:.1f} GB/s")
        for (fmt, isa), ts in times.items():
            t = statistics.median(ts)
            gbs = bytes_of[fmt] / t / 1e9
            rows.append([m, fmt, isa, t * 1e3, gbs, f"{100 * gbs / roofline:.0f}%"])
            print(f"M={m:2d} {fmt:8s} {isa:12s} {t * 1e3:8.2f} ms {gbs:6.1f} GB/s {100 * gbs / roofline:4.0f}%")
    headers = ["M", "weights", "path", "ms per pass", "GB/s of weights", "% of read bandwidth"]
    body = (
        f"{describe_cpu_kernels()}; {threads} threads; {len(f32)} linears, weights "
        + ", ".join(f"{fmt} {b / 1e6:.0f} MB" for fmt, b in bytes_of.items())
        + "; read bandwidth (torch.sum over 1 GiB, in the same rounds) "
        + ", ".join(f"{r:.1f} GB/s at M = {m}" for m, r in zip(ROWS, rooflines, strict=True))
        + f"; median of {args.rounds} rounds.\n\n"
        + md_table(headers, rows)
    )
    if not args.no_write:
        write_section(SECTION, "python benches/bench_cpu_isa.py --write", body, heading=f"## {SECTION}")


if __name__ == "__main__":
    main()
