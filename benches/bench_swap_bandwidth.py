"""Swap copy bandwidth: what the runner's swap path (``HostKVCache.swap``, the copies a
step's ``swap_out`` / ``swap_in`` arrays run) achieves, against this machine's plain copy
bandwidth measured in the same run.

For a few block counts (default 1, 8, 64, 256 blocks of the SmolLM2-135M geometry: 30 layers,
3 KV heads, head_dim 64, block size 16) and KV dtypes (float32, int8 with its bfloat16 scales),
it times device -> host (swap_out alone), host -> device (swap_in alone) and the round trip
(both in one call, the same blocks out and back, as ``ModelRunner.measure_swap_bandwidth``
does). The blocks are scattered (random block ids in a pool of ``--pool-blocks``), as a real
step's are. Bytes count each block once per direction (the round trip: twice), over the median
time of the repeats. The references, same run:

* memcpy, large: a ``--memcpy-mib`` torch tensor ``dst.copy_(src)`` and ``numpy.copyto`` (DRAM
  bandwidth; bytes copied / time, the same convention);
* memcpy, same size: a torch ``copy_`` of as many bytes as the swap moves (a small swap fits in
  the CPU caches, so this is its fair reference);
* on CUDA (when available): pinned host -> device and device -> host ``copy_`` of the large
  tensor, non-blocking and synchronized (the device is then the GPU, the host tier pinned).

    python benches/bench_swap_bandwidth.py [--blocks 1,8,64,256] [--dtypes float32,int8] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402

SECTION = "Swap copy bandwidth (issue 11)"


def smollm2_geometry() -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of the embedded model's config, or SmolLM2-135M's."""
    try:
        from pagedkv.worker.model_files import default_model_dir

        cfg = json.loads((Path(default_model_dir()) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"]), int(head_dim)
    except Exception:  # noqa: BLE001 - a benchmark falls back to the known geometry
        return 30, 3, 64


def median_seconds(fn: Callable[[], None], sync: Callable[[], None], *, min_repeats: int, min_time: float) -> float:
    """Median time of `fn` over at least `min_repeats` calls and `min_time` seconds, after 2 warm-ups."""
    for _ in range(2):
        fn()
    sync()
    times: list[float] = []
    total = 0.0
    while len(times) < min_repeats or total < min_time:
        start = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - start
        times.append(dt)
        total += dt
        if len(times) >= 10_000:
            break
    return statistics.median(times)


def make_caches(
    dtype: str, layers: int, heads: int, head_dim: int, block_size: int, pool: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A device KV cache [L, 2, pool, bs, Hkv, D] (and bfloat16 scales for int8), random content."""
    shape = (layers, 2, pool, block_size, heads, head_dim)
    if dtype == "int8":
        kv = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        scales = torch.rand(shape[:-1], dtype=torch.float32, device=device).to(torch.bfloat16)
        return kv, scales
    return torch.randn(shape, dtype=getattr(torch, dtype), device=device), None


def time_swaps(
    host: Any,
    swap_out: torch.Tensor,
    swap_in: torch.Tensor,
    nbytes: int,
    sync: Callable[[], None],
    args: argparse.Namespace,
) -> tuple[float, float, float, float]:
    """Median seconds of swap_out alone, swap_in alone, both, and a plain copy_ of nbytes."""
    kw = {"min_repeats": args.min_repeats, "min_time": args.min_time}
    t_out = median_seconds(lambda: host.swap(swap_out, None), sync, **kw)
    t_in = median_seconds(lambda: host.swap(None, swap_in), sync, **kw)
    t_rt = median_seconds(lambda: host.swap(swap_out, swap_in), sync, **kw)
    # The same bytes through one plain contiguous copy (cache-resident when small).
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    t_same = median_seconds(lambda: dst.copy_(src), lambda: None, **kw)
    return t_out, t_in, t_rt, t_same


def bench_swaps(args: argparse.Namespace, device: torch.device, sync: Callable[[], None]) -> list[dict]:
    from pagedkv.worker.host_cache import HostKVCache

    layers, heads, head_dim = smollm2_geometry()
    rng = np.random.default_rng(0)
    out: list[dict] = []
    for dtype in args.dtypes:
        kv, scales = make_caches(dtype, layers, heads, head_dim, args.block_size, args.pool_blocks, device)
        bytes_per_block = (kv[:, :, 0].numel() * kv.element_size()) + (
            0 if scales is None else scales[:, :, 0].numel() * scales.element_size()
        )
        host = HostKVCache(kv, scales, args.pool_blocks)
        for n in args.blocks:
            dev_ids = torch.from_numpy(rng.choice(args.pool_blocks, n, replace=False).astype(np.int64))
            host_ids = torch.from_numpy(rng.choice(args.pool_blocks, n, replace=False).astype(np.int64))
            swap_out = torch.stack([dev_ids, host_ids], dim=1)  # (device, host)
            swap_in = torch.stack([host_ids, dev_ids], dim=1)  # (host, device)
            nbytes = n * bytes_per_block
            t_out, t_in, t_rt, t_same = time_swaps(host, swap_out, swap_in, nbytes, sync, args)
            out.append(
                {
                    "dtype": dtype,
                    "blocks": n,
                    "bytes_per_block": bytes_per_block,
                    "bytes": nbytes,
                    "out_gbps": nbytes / t_out / 1e9,
                    "in_gbps": nbytes / t_in / 1e9,
                    "rt_gbps": 2 * nbytes / t_rt / 1e9,
                    "out_us": t_out * 1e6,
                    "in_us": t_in * 1e6,
                    "rt_us": t_rt * 1e6,
                    "same_size_memcpy_gbps": nbytes / t_same / 1e9,
                }
            )
            r = out[-1]
            print(
                f"{dtype:8} {n:4} blocks ({nbytes / 2**20:7.2f} MiB): out {r['out_gbps']:6.2f}  in {r['in_gbps']:6.2f}  "
                f"round trip {r['rt_gbps']:6.2f} GB/s; same-size copy_ {r['same_size_memcpy_gbps']:6.2f} GB/s",
                flush=True,
            )
    return out


def bench_breakdown(args: argparse.Namespace, blocks: int) -> list[list[object]]:
    """Two ways to copy `blocks` scattered float32 blocks on the CPU: the gather (``index_select``
    on the block axis, dim 2), the scatter (``index_copy_``) and the two together (an indexed
    swap, HostKVCache's CPU path before it was measured), against one ``copy_`` per block
    slice (its CPU path since)."""
    layers, heads, head_dim = smollm2_geometry()
    kv, _ = make_caches("float32", layers, heads, head_dim, args.block_size, args.pool_blocks, torch.device("cpu"))
    host = torch.zeros_like(kv)
    rng = np.random.default_rng(1)
    src = torch.from_numpy(rng.choice(args.pool_blocks, blocks, replace=False).astype(np.int64))
    dst = torch.from_numpy(rng.choice(args.pool_blocks, blocks, replace=False).astype(np.int64))
    gathered = kv.index_select(2, src)
    nbytes = gathered.numel() * gathered.element_size()
    pairs = list(zip(src.tolist(), dst.tolist()))

    def per_block() -> None:
        for i, j in pairs:
            host[:, :, j].copy_(kv[:, :, i])

    kw = {"min_repeats": args.min_repeats, "min_time": args.min_time}
    ops: list[tuple[str, Callable[[], object]]] = [
        ("index_select(2, ids) (gather)", lambda: kv.index_select(2, src)),
        ("index_copy_(2, ids, gathered) (scatter)", lambda: host.index_copy_(2, dst, gathered)),
        ("index_select + index_copy_ (indexed swap)", lambda: host.index_copy_(2, dst, kv.index_select(2, src))),
        ("one copy_ per block slice [:, :, i] (slice swap)", per_block),
    ]
    rows: list[list[object]] = []
    for name, fn in ops:
        gbps = nbytes / median_seconds(fn, lambda: None, **kw) / 1e9  # type: ignore[arg-type]
        rows.append([name, blocks, nbytes / 2**20, gbps])
        print(f"breakdown, float32 {blocks} blocks: {name}: {gbps:.2f} GB/s", flush=True)
    return rows


def bench_memcpy(args: argparse.Namespace) -> dict[str, float]:
    nbytes = args.memcpy_mib << 20
    kw = {"min_repeats": 5, "min_time": 0.5}
    src_t = torch.ones(nbytes // 4, dtype=torch.float32)
    dst_t = torch.zeros_like(src_t)
    refs = {"torch copy_": nbytes / median_seconds(lambda: dst_t.copy_(src_t), lambda: None, **kw) / 1e9}
    src_n, dst_n = src_t.numpy(), dst_t.numpy()
    refs["numpy copyto"] = nbytes / median_seconds(lambda: np.copyto(dst_n, src_n), lambda: None, **kw) / 1e9
    if torch.cuda.is_available():
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.fill_(1)

        def sync() -> None:
            torch.cuda.synchronize()

        refs["pinned H2D"] = nbytes / median_seconds(lambda: dev.copy_(pinned, non_blocking=True), sync, **kw) / 1e9
        refs["pinned D2H"] = nbytes / median_seconds(lambda: pinned.copy_(dev, non_blocking=True), sync, **kw) / 1e9
    for name, gbps in refs.items():
        print(f"reference {name}: {gbps:.2f} GB/s ({args.memcpy_mib} MiB)", flush=True)
    return refs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="1,8,64,256", help="comma-separated block counts per swap")
    ap.add_argument("--dtypes", default="float32,int8", help="comma-separated KV dtypes: float32, int8")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=512, help="blocks in the device pool and the host tier")
    ap.add_argument("--memcpy-mib", type=int, default=256, help="size of the large reference copies")
    ap.add_argument("--min-repeats", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of repeats per measurement, at least")
    ap.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda")
    add_write_flag(ap)
    args = ap.parse_args()
    args.blocks = [int(b) for b in args.blocks.split(",") if b.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtypes:
        if d not in ("float32", "float16", "bfloat16", "int8"):
            raise SystemExit(f"unknown dtype {d!r}: float32, float16, bfloat16, int8")
    if max(args.blocks) > args.pool_blocks:
        raise SystemExit(f"--pool-blocks {args.pool_blocks} must be >= the largest block count {max(args.blocks)}")
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if name == "auto" else name)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    refs = bench_memcpy(args)
    rows = bench_swaps(args, device, sync)
    breakdown = bench_breakdown(args, min(64, args.pool_blocks)) if device.type == "cpu" else []
    large = refs["torch copy_"]
    pcie = {"out": refs.get("pinned D2H"), "in": refs.get("pinned H2D")}
    table_rows: list[list[object]] = []
    for r in rows:
        row: list[object] = [
            r["dtype"],
            r["blocks"],
            r["bytes"] / 2**20,
            r["out_gbps"],
            r["in_gbps"],
            r["rt_gbps"],
            r["rt_us"],
            r["same_size_memcpy_gbps"],
            f"{r['rt_gbps'] / r['same_size_memcpy_gbps']:.0%}",
            f"{r['rt_gbps'] / large:.0%}",
        ]
        if device.type == "cuda" and pcie["out"] and pcie["in"]:
            row.append(f"{r['out_gbps'] / pcie['out']:.0%} / {r['in_gbps'] / pcie['in']:.0%}")
        table_rows.append(row)
    headers = [
        "KV dtype",
        "blocks",
        "MiB per direction",
        "out (D->H) GB/s",
        "in (H->D) GB/s",
        "round trip GB/s",
        "round trip us",
        "same-size copy_ GB/s",
        "round trip / same-size copy",
        f"round trip / {args.memcpy_mib} MiB copy_",
    ]
    if len(table_rows[0]) > len(headers):
        headers.append("out / pinned D2H, in / pinned H2D")
    table = md_table(headers, table_rows)
    layers, heads, head_dim = smollm2_geometry()
    ref_text = ", ".join(f"{k} {v:.2f} GB/s" for k, v in refs.items())
    bpb = ", ".join(sorted({f"{r['dtype']} {r['bytes_per_block']:,} B" for r in rows}))
    desc = (
        f"`HostKVCache.swap` (pagedkv.worker.host_cache), device {device} "
        f"({'pinned host tier, side stream' if device.type == 'cuda' else 'the device pool is CPU memory too: CPU-to-CPU block copies'}); "
        f"SmolLM2 geometry ({layers} layers, {heads} KV heads, head_dim {head_dim}, block size {args.block_size}), "
        f"bytes per block: {bpb} (int8: data + bfloat16 scales); random scattered block ids in a {args.pool_blocks}-block "
        f"pool and host tier; median of >= {args.min_repeats} calls and >= {args.min_time} s after 2 warm-ups. "
        f"GB/s = bytes moved per direction (round trip: both directions) / time, 1 GB = 1e9 B. References in the same run "
        f"({args.memcpy_mib} MiB): {ref_text}. torch {torch.__version__}, {torch.get_num_threads()} threads."
    )
    body = desc + "\n\n" + table
    small = [r for r in rows if r["dtype"] == args.dtypes[0] and r["blocks"] == 8]
    big = [r for r in rows if r["dtype"] == args.dtypes[0] and r["blocks"] == max(args.blocks)]
    if small and big:
        body += (
            f"\n\nThe engine's auto cost model uses `ModelRunner.measure_swap_bandwidth()` (a round trip of 8 blocks): "
            f"{small[0]['rt_gbps']:.2f} GB/s here for {args.dtypes[0]}, vs {big[0]['rt_gbps']:.2f} GB/s at "
            f"{big[0]['blocks']} blocks ({small[0]['rt_gbps'] / big[0]['rt_gbps']:.1f}x): 8 blocks stay in the CPU caches."
        )
    if breakdown:
        body += (
            "\n\nIndexed vs per-block slice copies on the CPU (float32, scattered blocks, GB/s of KV moved, one direction):\n\n"
            + md_table(["operation", "blocks", "MiB", "GB/s"], breakdown)
        )
    print(body)
    if not args.no_write:
        cmd = "python benches/bench_swap_bandwidth.py " + " ".join(sys.argv[1:])
        write_section(SECTION, cmd.strip(), body)


if __name__ == "__main__":
    main()
