"""KV capacity per cache dtype: how many blocks the same ``kv_cache_memory`` buys,
and what that does to a serving workload.

1. Pool size: a real :class:`pagedkv.worker.model_runner.ModelRunner` (the embedded SmolLM2,
   float32, CPU) is built per ``kv_cache_dtype`` with the same byte budget; the table gives its
   blocks, bytes per token (scales included) and the ratio to the float32 pool. Target: int8
   >= 3.8x float32.
2. Capacity study: ``pagedkv simulate`` (the real scheduler, no model) replays the same
   ShareGPT requests under that budget per dtype: peak and mean running sequences,
   preemptions, steps to finish, KV usage. A bfloat16 row (a GPU model's cache) is included.

    python benches/bench_kv_capacity.py [--kv-memory 256MiB] [--num-requests 1000] [--quick] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402

RUNNER_DTYPES = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]  # auto = float32 on the CPU
SIM_DTYPES = ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"]


def pool_sizes(budget: int) -> list[list[object]]:
    """Blocks a real runner allocates in ``budget`` bytes, per kv_cache_dtype."""
    from pagedkv.config import CacheConfig, ModelConfig
    from pagedkv.worker.model_runner import ModelRunner

    rows: list[list[object]] = []
    base = None
    for name in RUNNER_DTYPES:
        runner = ModelRunner(
            ModelConfig(device="cpu", max_model_len=256), CacheConfig(kv_cache_dtype=name, kv_cache_memory=budget)
        )
        g = runner.geometry
        base = base or runner.num_blocks
        allocated = runner.kv_cache.numel() * runner.kv_cache.element_size()
        if runner.kv_scale_cache is not None:
            allocated += runner.kv_scale_cache.numel() * runner.kv_scale_cache.element_size()
        rows.append(
            [
                f"{name} ({g.dtype})",
                g.bytes_per_token,
                runner.num_blocks,
                runner.num_blocks * runner.block_size,
                f"{allocated / 2**20:.1f}",
                f"{runner.num_blocks / base:.2f}x",
            ]
        )
        del runner
    return rows


def capacity_study(budget: int, num_requests: int) -> list[list[object]]:
    from pagedkv.sim.simulate import build_workload, simulate

    requests = build_workload("sharegpt", num_requests=num_requests, max_model_len=2048)
    rows: list[list[object]] = []
    for name in SIM_DTYPES:
        report = simulate(requests, kv_memory=budget, kv_dtype=name, baselines=False)
        paged = report["allocators"]["paged"]
        rows.append(
            [
                name,
                report["kv"]["bytes_per_token"],
                report["kv"]["num_blocks"],
                paged["peak_concurrent"],
                f"{paged['mean_concurrent']:.1f}",
                paged["preemptions"],
                paged["steps"],
                f"{paged['kv_usage']:.0%}",
            ]
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-memory", default="256MiB", help="KV budget (bytes or a size such as 256MiB)")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 50 requests, no RESULTS.md")
    add_write_flag(parser)
    args = parser.parse_args()
    from pagedkv.sim.kv_budget import parse_bytes

    memory = "128MiB" if args.quick else args.kv_memory
    num_requests = 50 if args.quick else args.num_requests
    budget = parse_bytes(memory, name="kv_memory")

    pools = md_table(
        ["kv_cache_dtype", "bytes/token", "blocks", "token slots", "allocated MiB", "vs float32"], pool_sizes(budget)
    )
    print(f"1. Pool in kv_cache_memory = {memory} (SmolLM2-135M: 30 layers x 3 KV heads x 64)\n")
    print(pools)
    study = md_table(
        ["KV dtype", "bytes/token", "blocks", "peak running", "mean running", "preemptions", "steps", "KV usage"],
        capacity_study(budget, num_requests),
    )
    print(f"\n2. pagedkv simulate, {num_requests} ShareGPT requests at t=0, {memory}, max_num_seqs 256\n")
    print(study)
    if not args.quick and not args.no_write:
        command = f"python benches/bench_kv_capacity.py --kv-memory {memory} --num-requests {num_requests}"
        body = (
            f"Pool in kv_cache_memory = {memory}, SmolLM2-135M (a real ModelRunner per dtype; scales "
            f"included in bytes/token):\n\n{pools}\n\n"
            f"Capacity study (`pagedkv simulate --kv-cache-dtype ...`), {num_requests} ShareGPT requests "
            f"arriving at t=0, the same {memory}:\n\n{study}"
        )
        write_section("KV cache capacity per dtype (issue 10)", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
