"""benches/bench_window_decode.py --quick: the three calls run and the ratio is printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_window_decode_quick_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "benches" / "bench_window_decode.py"), "--quick", "--rounds", "2"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "| 64 full |" in out and "| 512 window 64 |" in out and "| 512 full |" in out
    assert "512 window 64 / 64 full:" in out
