"""The hand-written stubs of the extension (python/pagedkv/_core.pyi) match the compiled module."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_stubtest_passes(tmp_path) -> None:
    if os.environ.get("PAGEDKV_STUBTEST_DONE"):
        pytest.skip("make test ran stubtest in make lint already")
    pytest.importorskip("mypy")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "pagedkv._core"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _stub_properties(class_name: str) -> set[str]:
    import ast
    from pathlib import Path

    stub = Path(__file__).resolve().parents[2] / "python" / "pagedkv" / "_core.pyi"
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {
                f.name
                for f in node.body
                if isinstance(f, ast.FunctionDef)
                and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
            }
    raise AssertionError(f"class {class_name} not in the stub")


def test_stub_scheduler_stats_attributes_equal_as_dict_keys() -> None:
    # stubtest checks each attribute exists on both sides; this also ties them to as_dict().
    import pagedkv

    stats = pagedkv.Scheduler(pagedkv.SchedulerConfig(num_blocks=4, block_size=4)).stats()
    assert _stub_properties("SchedulerStats") == set(stats.as_dict())
