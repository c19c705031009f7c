"""benches/bench_sampler.py --quick: both parts run end to end on tiny shapes (so the script
cannot rot); RESULTS.md is never written in quick mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _own_section() -> str | None:
    """This benchmark's section of RESULTS.md (other benchmarks may rewrite theirs meanwhile)."""
    results = REPO_ROOT / "benches" / "RESULTS.md"
    text = results.read_text() if results.exists() else ""
    start = text.find("<!-- BEGIN Sampler: cost per setting")
    return None if start < 0 else text[start : text.find("<!-- END Sampler: cost per setting", start)]


def test_bench_sampler_quick_runs(tmp_path: Path) -> None:
    before = _own_section()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benches" / "bench_sampler.py"), "--quick"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # Every setting of both parts made it into the tables.
    for name in ("greedy", "top_p 0.95, flat rows", "top_k 50 + top_p 0.95", "logprobs 5", "stress: top_k 1000"):
        assert f"| {name} |" in out, name
    assert "| seeded (temperature 0.8, top_p 0.95) |" in out
    assert "Engine step: worst setting" in out
    assert _own_section() == before
