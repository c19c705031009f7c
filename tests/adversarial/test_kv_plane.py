"""Attacks 1 and 2: the KV plane of a disaggregated deployment (router, prefill engine, decode
engine; ``pagedkv.router.launcher.start_disagg`` on the tiny random model, one transport).

1. **A client's ``kv_transfer_params``.** They name the blocks, the lease and the address a
   decode engine connects to, so only the router produces them: a client's get a 400 at the
   router. Whoever holds the engine key and goes to the decode engine directly gets a 400 for
   params of a wrong type, size, nesting or address (the decode engine pulls only from its
   prefill engine: ``allowed_producers``), before anything reaches the pull thread; forged
   well-formed params cost a recompute, never the request. The pull thread stays alive.
2. **Packets at the producer's control socket** from someone without the secret: non-ASCII
   MACs, nested JSON, garbage and oversized frames, wrong types, a flood of hellos. The
   producer refuses each (counted in ``pagedkv:background_errors``) and keeps serving leases.

Each attack runs through the harness (harness.py) beside an honest client whose requests go
through the router and pull their prompt's KV (a fresh ``cache_salt`` each, so nothing is a
prefix hit on the decode engine): its text is unchanged, the decode engine's ``kv_loads_ok``
grows by its requests, ``/health`` of the router and both engines says ok, and neither engine
loses a block (``/dev/check_invariants``; the leases are released). Last, in-process: a pull
thread that really dies (a ``SystemExit`` raised in it) makes ``/health`` degraded, naming it,
and no request waits for it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from harness import DEV_MODE_ENV, Attacks, error_of, post_json, zmtp_claim_frame  # noqa: E402

from pagedkv.distributed.control import THREAD_NAME, import_zmq  # noqa: E402
from pagedkv.distributed.kv_transport import nixl_available  # noqa: E402
from pagedkv.router.launcher import DisaggDeployment, start_disagg  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

# NIXL's engines start on their own (gloo's two form a group first): the faster to start.
TRANSPORT = "nixl" if nixl_available() else "gloo"
ENGINE_FLAGS = [
    "--num-blocks", "64", "--block-size", "16", "--max-model-len", "512", "--dtype", "float32", "--device", "cpu",
]  # fmt: skip
# About 50 tokens: full blocks to pull.
HONEST = (
    "The history of the lighthouse begins in the ancient world, where fires were lit on hills "
    "to guide ships home. Later, towers of stone carried the flame higher, and"
)
TIMEOUT = 60.0
PULL_THREAD = "pagedkv-kv-pull"


@pytest.fixture(scope="module")
def deployment(tiny_model: str) -> Iterator[DisaggDeployment]:
    config = {"kv_load_failure_policy": "recompute", "handshake_timeout": 5.0, "transfer_timeout": 10.0}
    with start_disagg(
        model=tiny_model,
        engine_flags=ENGINE_FLAGS,
        kv_transport=TRANSPORT,
        kv_transfer_config=config,
        env={**DEV_MODE_ENV, "OMP_NUM_THREADS": "1"},
        start_timeout=180,
    ) as dep:
        yield dep


@pytest.fixture(scope="module")
def attacks(deployment: DisaggDeployment, honest_rounds: int) -> Iterator[Attacks]:
    a = Attacks(
        deployment.url,
        engines=[deployment.prefill_url, deployment.decode_url],
        engine_headers=deployment.engine_headers(),
        honest_rounds=honest_rounds,
        quiet_rounds=honest_rounds,
        honest_prompt=HONEST,
        honest_fields=lambda: {"cache_salt": uuid.uuid4().hex},
    )
    yield a
    a.close()


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)


def total(url: str, name: str, label: str = "") -> float:
    """The sum of ``name`` over the series whose labels contain ``label``."""
    return sum(v for k, v in metrics(url).items() if k.split("{")[0] == name and label in k)


def run_checked(
    attacks: Attacks, deployment: DisaggDeployment, name: str, attack: Callable[[], Any], *, failed_loads: int = 0
) -> Any:
    """``attacks.run`` plus the KV plane's own checks: every honest request pulled its KV (the
    decode engine's ``kv_loads_ok`` grew by them), ``failed_loads`` pulls failed, both engines
    say ok with their KV threads alive, and every lease was released (no block left in use)."""
    d = deployment.decode_url
    ok, failed = total(d, "pagedkv:kv_loads_ok_total"), total(d, "pagedkv:kv_loads_failed_total")
    report = attacks.run(name, attack)
    assert total(d, "pagedkv:kv_loads_ok_total") >= ok + len(report.honest_s), "the honest requests pulled their KV"
    assert total(d, "pagedkv:kv_loads_failed_total") == failed + failed_loads
    for url, thread in ((deployment.prefill_url, THREAD_NAME), (d, PULL_THREAD)):
        health = httpx.get(url + "/health", timeout=TIMEOUT)
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        assert health.json()["threads"][thread]["alive"], health.text
    leases_released(attacks, deployment)
    return report.result


def leases_released(attacks: Attacks, deployment: DisaggDeployment) -> None:
    """Stricter than the harness (which lets a live lease hold blocks): the producer holds none."""
    deadline = time.monotonic() + TIMEOUT
    while (state := attacks.invariants(deployment.prefill_url))["num_kv_leases"] or state["num_used_blocks"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.1)


def honest_body(**more: Any) -> dict[str, Any]:
    return {"prompt": HONEST, "max_tokens": 8, "temperature": 0.0, **more}


# ----------------------------------------------------------------------------- attack 1


def test_a_clients_kv_transfer_params_get_a_400_at_the_router(attacks: Attacks, deployment: DisaggDeployment) -> None:
    hostile = {"do_remote_prefill": True, "remote_address": "tcp://10.255.255.1:9", "remote_lease_token": "x" * 43}
    chat = {"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": hostile}

    def attack() -> list[httpx.Response]:
        return [
            post_json(deployment.url + "/v1/completions", honest_body(kv_transfer_params=hostile)),
            post_json(deployment.url + "/v1/completions", honest_body(kv_transfer_params={"do_remote_decode": True})),
            post_json(deployment.url + "/v1/chat/completions", chat),
        ]

    for r in run_checked(attacks, deployment, "kv-params-via-router", attack):
        assert error_of(r, 400)["param"] == "kv_transfer_params"


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _params(**changes: Any) -> dict[str, Any]:
    """Well-formed params of HONEST's form, changed by ``changes``."""
    base = {
        "do_remote_prefill": True,
        "remote_engine_id": "p0",
        "remote_address": "tcp://127.0.0.1:1",
        "remote_request_id": "cmpl-x",
        "remote_block_ids": [1, 2, 3],
        "remote_num_tokens": 40,
        "remote_block_size": 16,
        "remote_kv_dtype": "float32",
        "prompt_digest": "0" * 32,
        "remote_lease_token": "A" * 43,
    }
    return {**base, **changes}


HOSTILE_PARAMS = {
    "nested": _nested(800),
    "nested-field": _params(remote_engine_id=_nested(800)),
    "nested-ids": _params(remote_block_ids=[_nested(500)]),
    "ids-not-a-list": _params(remote_block_ids="1,2,3"),
    "float-id": _params(remote_block_ids=[1.5, 2, 3]),
    "id-past-int32": _params(remote_block_ids=[2**40, 2, 3]),
    "tokens-a-str": _params(remote_num_tokens="40"),
    "negative-tokens": _params(remote_num_tokens=-1),
    "token-an-int": _params(remote_lease_token=123),
    "flag-a-str": _params(do_remote_prefill="true"),
    "long-id": _params(remote_request_id="r" * 100_000),
    "not-an-allowed-producer": _params(remote_address="tcp://10.255.255.1:9"),
    "ipc-address": _params(remote_address="ipc:///tmp/pagedkv-control"),
    "wildcard-address": _params(remote_address="tcp://*:5555"),
    "port-out-of-range": _params(remote_address="tcp://127.0.0.1:99999"),
    "non-ascii-address": _params(remote_address="tcp://é.example:1"),
    "huge-address": _params(remote_address="tcp://" + "a" * 5000 + ":1"),
}


def test_hostile_params_at_the_decode_engine_are_400s_and_the_pull_thread_lives(
    attacks: Attacks, deployment: DisaggDeployment
) -> None:
    url, headers = deployment.decode_url + "/v1/completions", deployment.engine_headers()
    errors_before = total(deployment.decode_url, "pagedkv:background_errors_total", PULL_THREAD)

    def attack() -> dict[str, httpx.Response]:
        answers = {
            name: post_json(url, honest_body(kv_transfer_params=params), headers=headers)
            for name, params in HOSTILE_PARAMS.items()
        }
        # Nested past the JSON parser's own depth: refused as a body that cannot be parsed.
        deep = b'{"prompt": "x", "kv_transfer_params": ' + b"[" * 20000 + b"]" * 20000 + b"}"
        answers["nested-past-the-parser"] = post_json(url, deep, headers=headers)
        return answers

    for name, r in run_checked(attacks, deployment, "kv-params-at-decode", attack).items():
        error = error_of(r, 400)
        if name != "nested-past-the-parser":
            assert error["param"] == "kv_transfer_params", (name, error)
    # Refused before the pull thread: it met none of them.
    assert total(deployment.decode_url, "pagedkv:background_errors_total", PULL_THREAD) == errors_before


def test_forged_well_formed_params_cost_a_recompute_not_the_request(
    attacks: Attacks, deployment: DisaggDeployment
) -> None:
    # Real params from the prefill engine (a lease on HONEST's KV), their token forged: the
    # producer refuses the claim, the decode engine computes the prompt itself, same text.
    headers = deployment.engine_headers()
    salt = uuid.uuid4().hex
    prefill = post_json(
        deployment.prefill_url + "/v1/completions",
        honest_body(max_tokens=1, cache_salt=salt, kv_transfer_params={"do_remote_decode": True}),
        headers=headers,
    )
    real = prefill.json()["kv_transfer_params"]
    assert real["remote_address"].startswith("tcp://127.0.0.1:"), real
    forged = {**real, "remote_lease_token": "F" * 43}

    def attack() -> list[str]:
        texts = []
        for params in (forged, real):  # the real one last: its lease is claimed and released
            r = post_json(
                deployment.decode_url + "/v1/completions",
                honest_body(cache_salt=salt, kv_transfer_params=params),
                headers=headers,
            )
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        return texts

    texts = run_checked(attacks, deployment, "forged-lease-token", attack, failed_loads=1)
    assert texts == [attacks.honest_text, attacks.honest_text]


# ----------------------------------------------------------------------------- attack 2


def _control_address(deployment: DisaggDeployment) -> str:
    info = httpx.get(deployment.prefill_url + "/kv_cache_info", headers=deployment.engine_headers(), timeout=TIMEOUT)
    address = info.json()["kv_transfer"]["control_address"]
    assert isinstance(address, str)
    return address


def _send(address: str, frames: list[bytes], *, answer: bool = True) -> dict[str, Any] | None:
    """``frames`` from a fresh DEALER (a REQ peer's are ``[b"", payload]``); the JSON answer
    (None when none came within a second). ``answer=False``: none is owed; a hello follows on
    the same connection and its nonce (the server answers a peer in order) shows the frames
    were read (None if the server dropped the connection: an oversized frame)."""
    zmq = import_zmq()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not answer:
            sock.send_multipart([b"", b'{"op": "hello"}'])
        if not sock.poll(1000):
            return None
        reply: dict[str, Any] = json.loads(sock.recv_multipart()[-1])
        return reply
    finally:
        sock.close()


def test_hostile_packets_at_the_producers_control_socket(attacks: Attacks, deployment: DisaggDeployment) -> None:
    address = _control_address(deployment)
    errors_before = total(deployment.prefill_url, "pagedkv:background_errors_total", THREAD_NAME)

    def signed_shape(**fields: Any) -> bytes:
        nonce = _send(address, [b"", b'{"op": "hello"}'])
        assert nonce is not None and nonce["ok"] is True
        envelope = {"nonce": nonce["nonce"], "cnonce": "c" * 32, "body": '{"op": "metadata"}', "mac": "0" * 64}
        return json.dumps({**envelope, **fields}, ensure_ascii=False).encode("utf-8", "surrogatepass")

    def attack() -> dict[str, Any]:
        refused = {
            "non-ascii-mac": [b"", signed_shape(mac="é" * 64)],
            "surrogate-nonce": [b"", signed_shape(nonce="\ud800", cnonce="\udfff")],
            "wrong-types": [b"", signed_shape(nonce=5, cnonce=[], body={}, mac=None)],
            "nested-json": [b"", b"[" * 30000 + b"]" * 30000],
            "nested-body": [b"", signed_shape(body="[" * 30000 + "]" * 30000)],
            "garbage": [b"", b"\xff\xfe\x00 not json"],
            "not-an-object": [b"", b"[1, 2, 3]"],
        }
        answers: dict[str, Any] = {name: _send(address, frames) for name, frames in refused.items()}
        # No answer is owed to these: not a REQ peer's shape, or past the size bound.
        for frames in ([b"lonely"], [b"", b"a", b"b"], [b""] * 100 + [b"{}"]):
            nonce = _send(address, frames, answer=False)
            assert nonce is not None and nonce["ok"] is True, (frames[:3], nonce)  # read, not answered
        # A frame past the bound: its sender is cut off at the frame's header, nothing buffered.
        assert zmtp_claim_frame(address, 1 << 30), "a 1 GiB frame's sender was not disconnected"
        answers["hellos"] = [_send(address, [b"", b'{"op": "hello"}']) for _ in range(200)]
        return answers

    answers = run_checked(attacks, deployment, "control-socket-packets", attack)
    hellos = answers.pop("hellos")
    assert all(h is not None and h["ok"] is True for h in hellos)
    for name, answer in answers.items():
        assert answer is not None and answer["ok"] is False and "body" not in answer, (name, answer)
    # Each refusal counted where the operator sees it.
    errors = total(deployment.prefill_url, "pagedkv:background_errors_total", THREAD_NAME)
    assert errors >= errors_before + len(answers), (errors_before, errors)


# ----------------------------------------------------------------------------- a thread that dies


@pytest.mark.skipif(not nixl_available(), reason="a lone consumer engine needs NIXL (gloo needs its peer)")
def test_health_is_degraded_naming_a_pull_thread_that_died(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette.testclient import TestClient

    from pagedkv.distributed.transfer_config import prompt_digest
    from pagedkv.engine.args import EngineArgs
    from pagedkv.server.app import DEV_MODE_ENV as DEV_ENV
    from pagedkv.server.app import create_app

    monkeypatch.setenv(DEV_ENV, "1")
    config = {"role": "consumer", "transport": "nixl", "auth_secret": "s" * 32}
    engine_args = EngineArgs(
        model=tiny_model, dtype="float32", device="cpu", block_size=16, num_blocks=64, max_model_len=512,
        kv_transfer_config=config,
    )  # fmt: skip
    with TestClient(create_app(engine_args)) as http:
        assert http.get("/health").json()["threads"][PULL_THREAD]["alive"]
        connector = http.app.state.pagedkv.engine.engine.kv_connector  # type: ignore[attr-defined]

        def die(*args: Any) -> Any:
            raise SystemExit("killed for the test")  # not an Exception: no guard catches it

        monkeypatch.setattr(connector, "_call", die)
        tokens = http.post("/tokenize", json={"prompt": HONEST}).json()["tokens"]
        params = _params(prompt_digest=prompt_digest(tokens), remote_num_tokens=len(tokens) - 1)
        params["remote_block_ids"] = list(range(-(-len(tokens) // 16)))
        texts = []
        for _ in range(2):  # the first pull kills the thread; the second finds it dead
            r = http.post("/v1/completions", json=honest_body(kv_transfer_params=params))
            assert r.status_code == 200, r.text  # computed here: nobody waits for the dead thread
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1]
        health = http.get("/health")
        assert health.status_code == 503, health.text
        body = health.json()
        assert body["status"] == "degraded" and body["dead"] == [PULL_THREAD], body
        assert "SystemExit" in body["threads"][PULL_THREAD]["died_of"]
        state = http.post("/dev/check_invariants").json()
        assert state["num_used_blocks"] == 0 and state["num_kv_reservations"] == 0, state
