"""Compile the Triton kernels for a GPU architecture on a machine without a GPU.

``python -m pagedkv.kernels.compile_check [--arch 90] [--quick] [--json]``

The CPU tests run the kernels in Triton's interpreter, which does not lower anything: a kernel
can pass them and still fail to compile for a GPU (an unsupported op, a type error in a
``while`` loop, too much shared memory) or compile into register spills. This tool closes that
gap: it launches the real host-side code of :mod:`.triton_attention` and :mod:`.triton_store`
(the same configs, the same specialisation of strides and alignments) on CPU tensors, with a
stand-in Triton driver that reports a CUDA target, and with every kernel switched to
``warmup`` (compile, never run). Triton's own ``ptxas`` assembles the result; the report lists
registers, spilled bytes (``STACK``) and shared memory per compiled variant.

It relies on two Triton internals (``triton.runtime.driver.set_active`` and
``JITFunction.run(..., warmup=True)``), both present in Triton 3.x. It must run in a fresh
process with ``TRITON_INTERPRET`` unset or 0 (``main`` checks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["CompiledVariant", "compile_all", "main"]


@dataclass
class CompiledVariant:
    kernel: str
    case: str
    registers: int
    spilled_bytes: int
    shared_bytes: int
    async_copies: int  # cp.async groups in the TTGIR: loads are software-pipelined
    wgmma: int  # Hopper warp-group MMAs in the TTGIR


class _CompileOnlyDriver:
    """Stands in for the CUDA driver: a target to compile for, nothing to run on."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):  # noqa: ANN201 (a triton GPUTarget)
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, spilled bytes) of a cubin, read with the cuobjdump that ships with Triton."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        listing = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", handle.name], capture_output=True, text=True, check=True
        ).stdout
    for line in listing.splitlines():
        fields = dict(f.split(":", 1) for f in line.split() if ":" in f and f.split(":", 1)[1].isdigit())
        if "REG" in fields:
            return int(fields["REG"]), int(fields.get("STACK", 0))
    raise RuntimeError(f"no resource usage in cuobjdump output:\n{listing}")


def _attention_cases(arch: int, quick: bool) -> list[tuple[str, dict]]:
    """(name, arguments) of launches that together reach every kernel variant the engine uses.

    ``quick`` keeps one case per distinct code path (padded head_dim, the head_dim-256 tiles,
    fp32's exact dots, quantized caches: int8 and float8 dequantized in registers with their
    scales; both decode epilogues once; the layer variants: window, chunk, soft-cap and sinks
    all at once, over a 16-bit and an int8 cache) for the CI test.
    """
    variants = [
        (torch.bfloat16, torch.bfloat16, 128),
        (torch.bfloat16, torch.bfloat16, 256),
        (torch.float16, torch.float16, 96),
        (torch.float32, torch.float32, 128),
        (torch.bfloat16, torch.int8, 128),
        (torch.float16, torch.float8_e5m2, 128),
    ]
    if not quick:
        variants.append((torch.bfloat16, torch.bfloat16, 64))
        variants.append((torch.bfloat16, torch.float8_e5m2, 128))
    if arch >= 89:  # float8 e4m3 exists from Ada / Hopper on
        variants.append((torch.bfloat16, torch.float8_e4m3fn, 128))
    if quick and arch < 90:
        variants = variants[:1] + variants[3:5]  # Ampere: the bf16, fp32 and int8 paths
    cases = []
    for index, (dtype, cache_dtype, head_dim) in enumerate(variants):
        for num_splits in (1, 4) if index == 0 or not quick else (4,):
            cases.append(
                (
                    f"{dtype}/{cache_dtype}/D{head_dim}/splits{num_splits}",
                    dict(dtype=dtype, cache_dtype=cache_dtype, head_dim=head_dim, num_splits=num_splits),
                )
            )
    # Layer variants (kernels/layer_attention.py): every constexpr flag on at once reaches every
    # extra line; the plain variants above are the full-attention kernels unchanged.
    for cache_dtype in (torch.bfloat16, torch.int8):
        cases.append(
            (
                f"{torch.bfloat16}/{cache_dtype}/D128/splits4/window+chunk+cap+sinks",
                dict(dtype=torch.bfloat16, cache_dtype=cache_dtype, head_dim=128, num_splits=4, layer=True),
            )
        )
    return cases


def _scales_for(cache: torch.Tensor, static: bool = False):  # noqa: ANN202 (KVScales | None)
    """Scales for a quantized cache (None for a float one), as the engine allocates them."""
    from pagedkv.kernels.kv_quant import SCALE_DTYPE, KVScales, format_of

    if format_of(cache.dtype) is None:
        return None
    num_blocks, block_size, num_kv_heads = cache.shape[:3]
    key, value = torch.empty(2, num_blocks, block_size, num_kv_heads, dtype=SCALE_DTYPE)
    if not static:
        return KVScales(key, value)
    static_scale = torch.ones(num_kv_heads, dtype=torch.float32)
    return KVScales(key, value, static_scale, static_scale)


def compile_all(arch: int = 90, quick: bool = False) -> list[CompiledVariant]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset or 0 (the kernels must be JIT functions)")
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_CompileOnlyDriver(arch))
    from pagedkv.kernels import triton_attention, triton_decode, triton_prefill, triton_store
    from pagedkv.kernels.layer_attention import FULL_ATTENTION, LayerAttention

    compiled: list[tuple[str, Any]] = []  # (case, triton CompiledKernel)
    current_case = [""]

    def compile_only(kernel: JITFunction):
        def run(*args, grid, warmup, **kwargs):  # noqa: ANN202
            result = JITFunction.run(kernel, *args, grid=grid, warmup=True, **kwargs)
            compiled.append((current_case[0], result))
            return result

        return run

    kernels = [
        triton_decode.decode_split_kernel,
        triton_decode.merge_splits_kernel,
        triton_prefill.prefill_kernel,
        triton_store._store_kv_kernel,
    ]
    for kernel in kernels:
        kernel.run = compile_only(kernel)
    try:
        for case_name, case in _attention_cases(arch, quick):
            current_case[0] = case_name
            num_heads, num_kv_heads, block_size, num_seqs = 32, 8, 16, 4
            query = torch.empty(num_seqs + 100, num_heads, case["head_dim"], dtype=case["dtype"])
            cache = torch.empty(64, block_size, num_kv_heads, case["head_dim"], dtype=case["cache_dtype"])
            kv_scales = _scales_for(cache)
            layer = FULL_ATTENTION
            if case.get("layer"):
                layer = LayerAttention(
                    sliding_window=100, chunk_size=256, logits_soft_cap=30.0, sinks=torch.zeros(num_heads)
                )
            triton_attention.paged_attention(
                query,
                cache,
                cache,
                torch.zeros(num_seqs, 40, dtype=torch.int32),
                torch.zeros(num_seqs, dtype=torch.int32),
                torch.zeros(num_seqs + 1, dtype=torch.int32),
                scale=0.1,
                out=torch.empty_like(query),
                max_seqlen_q=100,
                num_splits=case["num_splits"],
                kv_scales=kv_scales,
                layer=layer,
            )
        # (input dtype, cache dtype, static scales)
        store_dtypes = [
            (torch.bfloat16, torch.bfloat16, False),
            (torch.bfloat16, torch.int8, False),
            (torch.float16, torch.float8_e5m2, False),
        ]
        if not quick:
            store_dtypes.append((torch.bfloat16, torch.int8, True))
        if arch >= 89 and not quick:
            store_dtypes.append((torch.bfloat16, torch.float8_e4m3fn, False))
        for dtype, cache_dtype, static in store_dtypes:
            current_case[0] = f"store {dtype}->{cache_dtype}" + (" static" if static else "")
            new_kv = torch.empty(10, 8, 128, dtype=dtype)
            kv_cache = torch.empty(4, 16, 8, 128, dtype=cache_dtype)
            triton_store.store_kv(
                new_kv, new_kv, kv_cache, kv_cache, torch.zeros(10, dtype=torch.int64), _scales_for(kv_cache, static)
            )
    finally:
        for kernel in kernels:
            del kernel.run

    variants = []
    seen = set()
    for case_name, result in compiled:
        identity = (result.name, result.hash)
        if identity in seen:
            continue
        seen.add(identity)
        registers, spilled = _resource_usage(result.asm["cubin"])
        ttgir = result.asm["ttgir"]
        variants.append(
            CompiledVariant(
                kernel=result.name.lstrip("_"),
                case=case_name,
                registers=registers,
                spilled_bytes=spilled,
                shared_bytes=result.metadata.shared,
                async_copies=ttgir.count("async_copy_global_to_local"),
                wgmma=ttgir.count("warp_group_dot "),
            )
        )
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90 = Hopper, 80 = Ampere)")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    parser.add_argument("--quick", action="store_true", help="one case per code path (the CI test)")
    args = parser.parse_args(argv)
    variants = compile_all(args.arch, args.quick)
    if args.json:
        print(json.dumps([asdict(v) for v in variants]))
        return 0
    print(f"{'kernel':22s} {'case':44s} {'regs':>5s} {'spill':>6s} {'smem':>7s} {'cp.async':>8s} {'wgmma':>6s}")
    for v in variants:
        print(
            f"{v.kernel:22s} {v.case:44s} {v.registers:5d} {v.spilled_bytes:6d} {v.shared_bytes:7d} "
            f"{v.async_copies:8d} {v.wgmma:6d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
