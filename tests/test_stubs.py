"""The hand-written stubs of the extension (python/pagedkv/_core.pyi) match the compiled module."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_stubtest_passes(tmp_path) -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy.stubtest", "pagedkv._core"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
