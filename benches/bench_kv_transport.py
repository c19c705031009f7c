"""KV transfer throughput: pagedkv.distributed's NIXL and gloo transports moving block
runs between two processes' paged KV caches, against this machine's memcpy bandwidth (a torch
``copy_`` of the same regions between two tensors in one process) measured in the same run.

Geometry: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, block size 16, float32: 737,280 B
per block over all layers, K and V). Each transfer reads ``--blocks`` blocks (default 64) as runs
of 1, 4, 16 or 64 consecutive blocks; runs are separated by a one-block gap on both sides so they
cannot coalesce. A run of k blocks is 2 * 30 contiguous regions of k * 12,288 B each. The holder
is a spawned process; the reader (this process) pulls. GB/s = bytes moved / median time of the
transfers (start to completion, 1 GB = 1e9 B).

    python benches/bench_kv_transport.py [--runs 1,4,16,64] [--blocks 64] [--repeats 7] [--write]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, machine, md_table, write_section  # noqa: E402

from pagedkv.distributed.kv_transport import KVTransport, nixl_available  # noqa: E402
from pagedkv.distributed.transports import make_transport  # noqa: E402

SECTION = "kv_transport"
HEADING = "## KV transfer: NIXL and gloo vs memcpy (issue 13)"
OUT = Path(__file__).resolve().parent / "results"
LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
TIMEOUT = 60.0


def cache(num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, generator=g)


def transport(kind: str, port: int, rank: int) -> KVTransport:
    if kind == "gloo":
        return make_transport("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=TIMEOUT)
    return make_transport("nixl", engine_id=f"bench-{kind}-{rank}-{os.getpid()}")


def holder(kind: str, port: int, num_blocks: int, conn: Any) -> None:
    t = transport(kind, port, rank=1)
    t.register_kv_cache(cache(num_blocks, seed=1), None)
    # A holder serves only granted blocks (an engine grants a claimed lease's): all to the reader.
    reader = "gloo-rank0" if kind == "gloo" else f"bench-{kind}-0-{os.getppid()}"
    t.allow_reads(reader, "bench", range(num_blocks))
    conn.send(t.local_metadata())
    try:
        conn.recv()  # serve until the reader closes the pipe
    except EOFError:
        pass
    t.close()


def layout(run: int, blocks: int) -> tuple[list[int], list[int]]:
    """``blocks`` ids as runs of ``run``, a one-block gap after each run (remote and local)."""
    remote = [i * (run + 1) + j for i in range(blocks // run) for j in range(run)]
    local = [b + 1 for b in remote]  # shifted: a different local id for every block
    return remote, local


def bench_transport(kind: str, runs: list[int], blocks: int, repeats: int, num_blocks: int) -> dict[int, float]:
    port = 0
    if kind == "gloo":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=holder, args=(kind, port, num_blocks, child), daemon=True)
    proc.start()
    times: dict[int, float] = {}
    t = None
    try:
        t = transport(kind, port, rank=0)
        kv = cache(num_blocks, seed=2)
        t.register_kv_cache(kv, None)
        if not parent.poll(TIMEOUT):
            raise TimeoutError(f"{kind} holder did not start")
        peer = t.add_peer(parent.recv())
        for run in runs:
            remote, local = layout(run, blocks)
            samples = []
            for i in range(repeats + 2):  # 2 warm-ups (connection set-up, first touch)
                t0 = time.perf_counter()
                t.wait(t.read_blocks(peer, remote, local), timeout=TIMEOUT)
                if i >= 2:
                    samples.append(time.perf_counter() - t0)
            times[run] = statistics.median(samples)
        ref = cache(num_blocks, seed=1)
        assert torch.equal(kv[:, :, local], ref[:, :, remote]), f"{kind}: bytes differ"
    finally:
        if t is not None:
            t.close()
        parent.close()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    return times


def bench_memcpy(runs: list[int], blocks: int, repeats: int, num_blocks: int) -> dict[int, float]:
    src, dst = cache(num_blocks, seed=1), cache(num_blocks, seed=2)
    times = {}
    for run in runs:
        remote, local = layout(run, blocks)
        starts = [(remote[i], local[i]) for i in range(0, len(remote), run)]

        samples = []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            for r, loc in starts:
                dst[:, :, loc : loc + run].copy_(src[:, :, r : r + run])
            if i >= 2:
                samples.append(time.perf_counter() - t0)
        times[run] = statistics.median(samples)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="1,4,16,64")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per transfer")
    ap.add_argument("--repeats", type=int, default=7)
    add_write_flag(ap)
    args = ap.parse_args()
    runs = [int(x) for x in args.runs.split(",")]
    num_blocks = 2 * args.blocks + 1  # room for the gaps between runs of 1
    bytes_per_block = LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4
    nbytes = args.blocks * bytes_per_block

    load = os.getloadavg()[0]  # a shared machine: say how busy it was
    kinds = (["nixl"] if nixl_available() else []) + ["gloo"]
    results: dict[str, dict[int, float]] = {"memcpy": bench_memcpy(runs, args.blocks, args.repeats, num_blocks)}
    for kind in kinds:
        results[kind] = bench_transport(kind, runs, args.blocks, args.repeats, num_blocks)

    rows = []
    for run in runs:
        mem = nbytes / results["memcpy"][run] / 1e9
        row: list[object] = [run, args.blocks // run, 2 * LAYERS * (args.blocks // run), f"{nbytes / 2**20:.1f}", mem]
        for kind in kinds:
            gbps = nbytes / results[kind][run] / 1e9
            row += [gbps, f"{results[kind][run] * 1e3:.1f}", f"{gbps / mem:.2f}"]
        rows.append(row)
    headers = ["run (blocks)", "runs", "regions", "MiB / transfer", "memcpy GB/s"]
    for kind in kinds:
        headers += [f"{kind} GB/s", f"{kind} ms", f"{kind} / memcpy"]
    table = md_table(headers, rows)
    nixl_note = (
        "NIXL 1.5.1 (nixl-cu13 wheel), UCX backend, host DRAM on both sides, no UCX environment variables "
        "(on this machine UCX reads through CMA, zero-copy, and sends control messages over TCP on lo); "
        if "nixl" in kinds
        else "NIXL not installed: gloo only; "
    )
    desc = (
        f"Two processes on one machine, SmolLM2-135M geometry ({LAYERS} layers, {HEADS} KV heads, head_dim {HEAD_DIM}, "
        f"block size {BLOCK_SIZE}, float32: {bytes_per_block:,} B per block), {args.blocks} blocks per transfer as runs "
        f"separated by gaps, {num_blocks}-block caches; median of {args.repeats} transfers after 2 warm-ups, "
        f"start to completion. {nixl_note}gloo: torch {torch.__version__} ProcessGroupGloo over loopback TCP "
        f"(request via the TCPStore, one gathered send, scatter on the reader). memcpy: torch `copy_` of the same "
        f"regions between two tensors in this process ({torch.get_num_threads()} threads). "
        f"1-minute load average at start: {load:.1f} (other jobs share these cores: expect noise)."
    )
    body = desc + "\n\n" + table
    print(body)
    cmd = ("python benches/bench_kv_transport.py " + " ".join(sys.argv[1:])).strip()
    record = {
        "command": cmd,
        "machine": machine(),
        "bytes_per_block": bytes_per_block,
        "blocks_per_transfer": args.blocks,
        "repeats": args.repeats,
        "load_average_1m": load,
        "seconds": {k: {str(r): v for r, v in d.items()} for k, d in results.items()},
        "gbps": {k: {str(r): nbytes / v / 1e9 for r, v in d.items()} for k, d in results.items()},
    }
    if not args.no_write:
        OUT.mkdir(exist_ok=True)
        (OUT / "kv_transport.json").write_text(json.dumps(record, indent=2) + "\n")
        (OUT / "kv_transport.md").write_text(
            f"{HEADING.removeprefix('## ')}\n\nCommand: `{cmd}`  \nMachine: {machine()}\n\n{body}\n"
        )
        write_section(SECTION, cmd, body, HEADING)


if __name__ == "__main__":
    main()
