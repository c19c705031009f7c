"""benches/bench_kv_capacity.py --quick runs end to end (so the script cannot rot) and reports
the pool ratio the issue targets; quick mode never writes RESULTS.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_kv_capacity_quick_runs(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benches" / "bench_kv_capacity.py"), "--quick"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ratio = re.search(r"\| int8 \(int8\) \|.*\| ([\d.]+)x \|", proc.stdout)
    assert ratio is not None, proc.stdout
    assert float(ratio.group(1)) >= 3.8
    assert "| fp8_e5m2 | 11880 |" in proc.stdout
