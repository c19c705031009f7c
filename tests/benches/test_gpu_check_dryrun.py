"""benches/gpu_check.py --dry-run: every section runs end to end on tiny CPU shapes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_writes_its_report(tmp_path):
    out = tmp_path / "nested" / "gpu_check.json"
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the script must set it itself for --dry-run
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benches" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout

    report = json.loads(out.read_text())
    assert report["meta"]["dry_run"] is True and report["meta"]["device"] == "cpu"
    assert report["correctness_failures"] == []
    assert set(report) >= {
        "meta", "correctness", "copy_bandwidth", "decode", "prefill", "quantized", "sliding_window", "soft_cap", "sinks",
        "engine", "cuda_graphs", "targets",
    }  # fmt: skip
    # Decode steps through the graphs' buffers (not captured on the CPU) give the same tokens.
    assert report["cuda_graphs"]["identical_completions"] == "4/4"

    sweep = report["correctness"]["table"]
    assert sweep and all(row["passed"] and row["max_error"] <= row["atol"] for row in sweep)
    quantized_cases = [row for row in sweep if "cache" in row["case"]]  # int8, fp8 e5m2 and e4m3 caches with scales
    assert len(quantized_cases) == 3 and all(row["store_exact"] for row in quantized_cases)
    assert report["copy_bandwidth"]["bandwidth_gbps"] > 0

    decode = report["decode"]["table"]
    assert len(decode) == 4  # batches {1, 2} x contexts {32, 64}, one GQA shape
    for row in decode:
        for key in ("paged_us", "sdpa_us", "paged_GB/s", "pct_of_copy", "paged/sdpa"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    prefill = report["prefill"]["table"]
    assert [row["layout"] for row in prefill] == ["1x48", "2x16"]
    assert all(row["paged_TFLOP/s"] > 0 for row in prefill)
    quantized = report["quantized"]
    assert len(quantized["table"]) == 3 * 4  # formats x batches {1, 2} x contexts {32, 64}
    for row in quantized["table"]:
        for key in ("paged_us", "paged_GB/s", "pct_of_copy", "time_vs_16bit"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert [row["format"] for row in quantized["prefill"]] == ["int8", "fp8_e5m2", "fp8_e4m3"]
    assert [row["cache"] for row in quantized["store"]] == ["float32", "int8", "fp8_e5m2", "fp8_e4m3"]
    # Layer variants against the oracle, the blocks behind each window dropped (NaN, -1 entries).
    for section in ("sliding_window", "soft_cap", "sinks"):
        rows = report[section]["table"]
        assert rows and all(row["passed"] and row["max_error"] <= row["atol"] for row in rows), section
        assert all(row["store_exact"] for row in rows if "cache" in row["case"])
        assert all(row["dropped_blocks"] > 0 for row in rows if "window" in row["case"] or "chunk" in row["case"])
        timing = report[section]["timing"]
        assert [row["case"] == "full" for row in timing] == [True, False]
        assert all(math.isfinite(row[key]) and row[key] > 0 for row in timing for key in ("short_us", "long_us"))
    assert [len(report[section]["table"]) for section in ("sliding_window", "soft_cap", "sinks")] == [5, 4, 5]
    # Tiny shapes read far less than 0.5 GB: no performance target applies.
    assert report["targets"] == []

    engine = report["engine"]
    assert engine["requests"] == 4 and engine["speedup"] > 0
    assert [row["output_tokens"] for row in engine["table"]] == [4 + 5 + 6 + 7] * 2  # both engines, all tokens
