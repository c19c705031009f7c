"""Helpers for benchmark scripts: machine description, timing, and writing a section of
benches/RESULTS.md (between `<!-- BEGIN name -->` and `<!-- END name -->` markers, so each
benchmark rewrites only its own section).

Writing the record is opt-in: a bench updates the tracked RESULTS.md (and its plots) only with
`--write` (:func:`add_write_flag`); a plain run prints its figures and leaves the tree alone."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores{mem}{_vector_flags()}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}"
    )


# The CPU flags a figure can depend on (the kernels' instruction sets), as /proc/cpuinfo names them.
_VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def _vector_flags() -> str:
    """``, flags: avx2 fma ...``: which of the vector flags the CPU has (empty off Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return ", flags: " + " ".join(f for f in _VECTOR_FLAGS if f in have)
    except OSError:
        pass
    return ""


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def time_calls(fn: Callable[[], object], *, repeat: int, warmup: int = 3) -> dict[str, float]:
    """Times `repeat` calls of `fn`; returns median / mean / p10 / p90 in microseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t) / 1000)
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "mean_us": statistics.fmean(samples),
        "p10_us": samples[len(samples) // 10],
        "p90_us": samples[(len(samples) * 9) // 10],
    }


def add_write_flag(parser: argparse.ArgumentParser) -> None:
    """`--write`: record this run in benches/RESULTS.md (and its plot); off by default. The
    benches read `args.no_write` (True unless `--write`). `--no-write`, the old way to say the
    default, is still accepted."""
    parser.add_argument(
        "--write",
        dest="no_write",
        action="store_false",
        default=True,
        help="record this run in benches/RESULTS.md (and its plot); default: print only",
    )
    parser.add_argument("--no-write", dest="no_write", action="store_true", default=True, help=argparse.SUPPRESS)


def write_section(name: str, command: str, body: str, heading: str | None = None) -> None:
    """Replaces the section `name` of benches/RESULTS.md, or appends it under `heading` (a
    markdown heading line; default `## name`) the first time."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    block = (
        f"<!-- BEGIN {name} -->\n"
        f"Command: `{command}`  \nMachine: {machine()}  \nCommit: {git_rev()}, {stamp}\n\n"
        f"{body.rstrip()}\n<!-- END {name} -->"
    )
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + f"\n\n{heading or '## ' + name}\n\n{block}\n"
    RESULTS.write_text(text)


def md_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CPU accounting
# The machines are shared: the serving benchmarks report the CPU time of each process they
# start and of the whole machine during a run, so a run slowed by other jobs can be told apart.


def cpu_seconds_self() -> float:
    """User + system CPU seconds of this process so far."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_seconds_pid(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def cpu_seconds_machine() -> float:
    """Busy CPU seconds of the whole machine (all cores) so far, from /proc/stat."""
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (
            int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        )
    except (OSError, ValueError):
        return float("nan")
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of `values` (nan when empty)."""
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")
