"""benches/bench_kv_quality.py --quick runs end to end (so the script cannot rot): the teacher-
forced comparison and the decode cross-check print their rows; quick mode never writes
RESULTS.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SECTION = "<!-- BEGIN KV cache quality: quantized vs full-precision KV (issue 10)"


def _own_section() -> str | None:
    results = REPO_ROOT / "benches" / "RESULTS.md"
    text = results.read_text() if results.exists() else ""
    start = text.find(SECTION)
    return None if start < 0 else text[start : text.find("<!-- END", start)]


def test_bench_kv_quality_quick_runs(tmp_path: Path) -> None:
    before = _own_section()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benches" / "bench_kv_quality.py"),
            "--quick",
            "--dtypes",
            "int8",
            "--decode-check",
            "4",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| auto (float32) | 318 | 0 |" in out, out
    row = re.search(r"^\| int8 \| 318 \| ([\d.e-]+) \|.*\| ([\d.]+)% \|", out, re.M)
    assert row is not None, out
    assert float(row.group(1)) < 0.05  # mean KL in nats: int8 is close to full precision
    assert float(row.group(2)) > 80.0  # top-1 agreement
    assert re.search(r"^\| auto \| 4 \|", out, re.M) and re.search(r"^\| int8 \| 4 \|", out, re.M), out
    assert _own_section() == before
