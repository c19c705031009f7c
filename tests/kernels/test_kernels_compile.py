"""The Triton kernels compile for real GPUs (Hopper, Ampere) on this GPU-less machine.

The interpreter tests check the kernels' arithmetic; they lower nothing. Here every kernel
variant the launch code can pick is compiled by Triton and assembled by its ``ptxas`` for
sm_90 and sm_80 (see :mod:`pagedkv.kernels.compile_check`), and the resource report is checked
for the properties the kernels were designed for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


def _compile(arch: int) -> list[dict]:
    triton = pytest.importorskip("triton")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not ((tools / "ptxas").exists() and (tools / "cuobjdump").exists()):
        pytest.skip("this Triton build ships no NVIDIA toolchain (ptxas, cuobjdump)")
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PYTHON_DIR), env.get("PYTHONPATH", "")) if p)
    env["TRITON_INTERPRET"] = "0"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv.kernels.compile_check", "--arch", str(arch), "--quick", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", [90, 80])
def test_every_kernel_variant_compiles(arch):
    variants = _compile(arch)
    kernels = {v["kernel"] for v in variants}
    assert kernels == {"decode_split_kernel", "merge_splits_kernel", "prefill_kernel", "store_kv_kernel"}
    cases = {v["case"] for v in variants}
    # Quantized caches (int8 everywhere, float8 e5m2 on Hopper) compile, attention and store.
    assert any("torch.int8/" in case for case in cases) and "store torch.bfloat16->torch.int8" in cases
    if arch >= 90:
        assert any("float8_e5m2/" in case for case in cases)
    # The layer variants (window, chunk, soft-cap, sinks) compile for both kernels, 16-bit and int8.
    variant_kernels = {(v["kernel"], "int8" in v["case"]) for v in variants if "window+chunk+cap+sinks" in v["case"]}
    assert variant_kernels >= {(k, q) for k in ("decode_split_kernel", "prefill_kernel") for q in (False, True)}
    for v in variants:
        half_precision = "float32/" not in v["case"]  # bf16 / fp16 queries, 16-bit or quantized caches
        if half_precision:
            assert v["spilled_bytes"] == 0, v  # 16-bit paths must not spill registers
        if v["kernel"] in ("decode_split_kernel", "prefill_kernel"):
            assert v["async_copies"] > 0, v  # K/V loads are software-pipelined (cp.async)
        if arch == 90 and v["kernel"] == "prefill_kernel" and half_precision:
            assert v["wgmma"] > 0, v  # Hopper prefill runs on warp-group MMA
