"""The attack suite's setup (see harness.py): how many honest requests each attack is measured
with, and, in benchmark mode, the table of the honest client's latency under each attack.

Benchmark mode: ``PAGEDKV_ATTACK_BENCH=N`` (N honest requests per attack and at rest; default
off: one each) and ``PAGEDKV_ATTACK_BENCH_OUT=FILE`` (one JSON line per attack, appended: each
xdist worker writes its own). ``python benches/bench_attacks.py`` runs the suite that way and
writes the table to benches/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest
from harness import DEV_MODE_ENV, REPORTS, Attacks

from pagedkv.server.launch import ServerProcess


@pytest.fixture(scope="session")
def honest_rounds() -> int:
    """Honest requests per attack (and at rest): 1, or N in benchmark mode."""
    return max(1, int(os.environ.get("PAGEDKV_ATTACK_BENCH", "0") or 0))


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """One real server per attack module, started with the module's ``FLAGS``, serving its
    development endpoints (``/dev/check_invariants``)."""
    with ServerProcess(request.module.FLAGS, env=DEV_MODE_ENV, start_timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def attacks(server: ServerProcess, honest_rounds: int) -> Iterator[Attacks]:
    """The harness on the module's server (measured at rest once, when it is made)."""
    a = Attacks(server.url, honest_rounds=honest_rounds, quiet_rounds=honest_rounds)
    yield a
    a.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not REPORTS or not os.environ.get("PAGEDKV_ATTACK_BENCH"):
        return
    lines = [json.dumps({**r.as_dict(), "host": socket.gethostname()}) for r in REPORTS]
    out = os.environ.get("PAGEDKV_ATTACK_BENCH_OUT")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    print("\nhonest client under attack (median s, at rest, ratio):")
    for r in REPORTS:
        print(f"  {r.name:40s} {r.as_dict()['honest_median_s']:7.3f} {r.quiet_s:7.3f} {r.ratio:6.2f}x")
