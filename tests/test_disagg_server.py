"""Disaggregated prefill / decode between two `pagedkv serve` processes, driven over HTTP the way
a proxy drives them, per transport: the producer's answer carries ``kv_transfer_params``; the
consumer pulls the KV and decodes; bad ``kv_transfer_params`` are 400s; a producer killed
(SIGKILL) while holding a lease costs the consumer a recompute, never the request, and neither
engine keeps a block. (The router in front of them: test_router_disagg.py; the engine-level
cases, the ``fail`` policy and lease expiry: test_kv_connector.py.)
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from kv_transports import TRANSPORTS  # noqa: E402

from pagedkv.router.launcher import DisaggDeployment, start_disagg  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

TIMEOUT = 60.0
ENGINE_FLAGS = ["--num-blocks", "64", "--block-size", "16", "--max-model-len", "512", "--dtype", "float32"]
ENV = {"OMP_NUM_THREADS": "1"}
PROMPT = (
    "A paged KV cache keeps each sequence's keys and values in fixed-size blocks, allocated as "
    "the sequence grows and returned to a free pool when it ends, so that memory is not reserved "
    "for the longest possible answer. The block table of a sequence maps"
)
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module", params=TRANSPORTS)
def deployment(request: pytest.FixtureRequest) -> Iterator[DisaggDeployment]:
    config = {"kv_load_failure_policy": "recompute", "handshake_timeout": 2.0, "transfer_timeout": 10.0}
    with start_disagg(
        engine_flags=ENGINE_FLAGS, kv_transport=request.param, kv_transfer_config=config, env=ENV, start_timeout=120
    ) as dep:
        yield dep


def metric(url: str, name: str) -> float:
    m = parse_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
    return sum(v for k, v in m.items() if k.split("{")[0] == name)


def prefill(http: httpx.Client, url: str, prompt: str) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
    r = http.post(url + COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return dict(params)


def decode(http: httpx.Client, url: str, prompt: str, params: dict[str, Any] | None) -> str:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 10, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    r = http.post(url + COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def settle(url: str, name: str, value: float) -> None:
    """Waits until the engine's metric reaches ``value`` (stats are read between steps)."""
    deadline = time.monotonic() + TIMEOUT
    while metric(url, name) != value:
        assert time.monotonic() < deadline, f"{name} != {value}"
        time.sleep(0.05)


def test_pull_over_http_then_a_killed_producer(deployment: DisaggDeployment) -> None:
    p, d = deployment.prefill_url, deployment.decode_url
    # The engines answer only the deployment's router (and whoever holds its engine key).
    for url in (p, d):
        r = httpx.post(url + COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 1}, timeout=TIMEOUT)
        assert r.status_code == 401, r.text
    with httpx.Client(timeout=TIMEOUT, headers=deployment.engine_headers()) as http:
        info = http.get(d + "/kv_cache_info").json()["kv_transfer"]
        assert info["role"] == "consumer"
        assert http.get(p + "/kv_cache_info").json()["kv_transfer"]["control_address"].startswith("tcp://127.0.0.1:")

        params = prefill(http, p, PROMPT)
        pulled = decode(http, d, PROMPT, params)
        assert metric(d, "pagedkv:kv_loads_ok_total") == 1
        # Every full block but one holding the last prompt token (computed here for its logits).
        assert metric(d, "pagedkv:kv_blocks_pulled_total") == (params["remote_num_tokens"] - 1) // 16
        settle(p, "pagedkv:kv_leases", 0)  # released by the reader, not expired
        assert metric(p, "pagedkv:kv_leases_expired_total") == 0
        http.post(d + "/reset_prefix_cache")
        assert decode(http, d, PROMPT, None) == pulled  # computed here: the same text

        # Bad kv_transfer_params are 400s, on both sides; the engines keep serving.
        bad = [
            (p, {"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}, "stream": True}),
            (p, {"prompt": [PROMPT, PROMPT], "kv_transfer_params": {"do_remote_decode": True}}),
            (p, {"prompt": PROMPT, "kv_transfer_params": {"bogus": 1}}),
            (p, {"prompt": PROMPT, "kv_transfer_params": "yes"}),
            (d, {"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}}),  # not a producer
            (d, {"prompt": PROMPT + " other", "kv_transfer_params": params}),  # another prompt's KV
        ]
        for url, body in bad:
            r = http.post(url + COMPLETIONS, json=body)
            assert r.status_code == 400, (body, r.text)

        # The producer dies holding a lease: the pull fails and the consumer computes the prompt.
        params = prefill(http, p, PROMPT)
        deployment.prefill.signal(signal.SIGKILL)
        deployment.prefill.wait(TIMEOUT)
        http.post(d + "/reset_prefix_cache")
        assert decode(http, d, PROMPT, params) == pulled
        assert metric(d, "pagedkv:kv_loads_failed_total") == 1
        settle(d, "vllm:kv_cache_usage_perc", 0)
        settle(d, "pagedkv:kv_requests_waiting_for_remote", 0)
