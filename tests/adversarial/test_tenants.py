"""Attack 9: nothing a tenant's requests leave behind reaches another tenant (``cache_salt``).

Suffix decoding drafts from the outputs of recent requests, and a new sample's draft count
follows the acceptance of recent rows: both are stores that outlive a request. Keyed by
nothing, tenant A's outputs became tenant B's drafts, and B learned what A generated from the
tokens accepted (and from its own step times). Both are keyed by the cache salt now, as the
prefix cache is.

One real server (SmolLM2, suffix decoding with a fixed draft count, so acceptance depends on
the drafts alone); B's acceptance is read from the server's own counters
(``vllm:spec_decode_num_accepted_tokens``), one request at a time.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from harness import Attacks, post_json  # noqa: E402

from pagedkv.server.launch import ServerProcess  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}
FLAGS = [
    "--dtype", "float32", "--device", "cpu", "--block-size", "16", "--num-blocks", "96",
    "--max-model-len", "256", "--max-num-seqs", "4", "--speculative-config", json.dumps(SUFFIX),
]  # fmt: skip
# A prompt whose greedy continuation does not repeat itself: drafts from the request's own tokens
# are few, drafts from an earlier output of the same text are many.
PROMPT = "Write one sentence about the history of the printing press in Europe:"
MAX_TOKENS = 32


def accepted_and_text(server: ServerProcess, salt: str | None) -> tuple[int, int, str]:
    """One greedy request of tenant ``salt``: the drafts the server verified for it, the
    drafts it accepted, and its text (the server runs nothing else meanwhile)."""

    def counters() -> tuple[float, float]:
        m = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
        return m["vllm:spec_decode_num_draft_tokens_total{}"], m["vllm:spec_decode_num_accepted_tokens_total{}"]

    drafted0, accepted0 = counters()
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = post_json(server.url + "/v1/completions", body)
    assert r.status_code == 200, r.text
    drafted1, accepted1 = counters()
    return int(drafted1 - drafted0), int(accepted1 - accepted0), str(r.json()["choices"][0]["text"])


def test_suffix_decoding_never_drafts_from_another_tenants_outputs(server: ServerProcess, attacks: Attacks) -> None:
    # Tenant B before anyone else sent this prompt (a salt nobody used).
    alone = accepted_and_text(server, "tenant-b-first")

    def tenant_a() -> tuple[int, int, str]:
        return accepted_and_text(server, "tenant-a")

    report = attacks.run("suffix-decoding-across-tenants", tenant_a)
    a_first = report.result
    assert a_first[2] == alone[2], "the same prompt, greedy: the same text"
    # A's second request drafts from A's first output: the store works within a tenant (so
    # the check below can fail), and accepts far more than B alone did.
    a_again = accepted_and_text(server, "tenant-a")
    assert a_again[1] > alone[1] + MAX_TOKENS // 4, (a_again, alone)
    # Tenant B after A, under a salt of its own: exactly what it had with nobody before it.
    after = accepted_and_text(server, "tenant-b-second")
    assert after == alone, f"tenant B's drafts depend on tenant A's outputs: {after} vs {alone}"
