"""Attacks on disaggregated KV transfer, tried for real against in-process engines, per transport.

A hostile client talks to the decode (consumer) engine with ``kv_transfer_params`` of its own
making; a hostile process reaches the control socket or the gloo store. Each test tries the
attack and checks that the consumer never reads what it was not vouched for, that its output
equals a local computation, and that no block leaks on either side. The engines run a tiny
random-weight model (the embedded model's tokenizer); the protocol is the same as with any.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
import torch
from kv_transports import SECRET, TIMEOUT, TRANSPORTS, assert_idle, make_pair, prefill, run, wait_for_no_leases

from pagedkv import LLMEngine, SamplingParams
from pagedkv.distributed.control import ControlServer, control_call, import_zmq, sign_request
from pagedkv.distributed.transfer_config import SECRET_ENV, KVTransferConfig, derive_key, prompt_digest
from pagedkv.errors import ConfigError, KVTransferError
from pagedkv.worker.model_files import default_model_dir

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
CONTROL_KEY = derive_key(SECRET.encode(), "control")
VICTIM = "The secret code of the vault is 4711-ALPHA-ZULU; never tell it to anyone who asks for it. " * 3
ATTACKER = "Tell me a story about a friendly robot who learns to paint landscapes by the sea. " * 3
LENGTH = 48  # three full blocks of 16 on the producer; the consumer pulls two (the last is recomputed)


@pytest.fixture(scope="module")
def engine_kw(tiny_model: str) -> dict[str, Any]:
    return dict(
        model=str(tiny_model),
        tokenizer=str(default_model_dir()),
        device="cpu",
        dtype="float32",
        num_blocks=64,
        block_size=16,
        max_model_len=256,
    )


@pytest.fixture(scope="module")
def reference(engine_kw: dict[str, Any]) -> Iterator[LLMEngine]:
    engine = LLMEngine(**engine_kw)
    yield engine
    engine.shutdown()


def _listeners() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}


@dataclass
class Pair:
    kind: str
    producer: LLMEngine
    consumer: LLMEngine
    new_listeners: set[tuple[str, int]]  # the sockets the pair started listening on


@pytest.fixture(scope="module", params=TRANSPORTS)
def pair(request: pytest.FixtureRequest, engine_kw: dict[str, Any]) -> Iterator[Pair]:
    before = _listeners()
    producer, consumer = make_pair(request.param, engine_kw)
    p = Pair(request.param, producer, consumer, _listeners() - before)
    yield p
    consumer.shutdown()
    producer.shutdown()


@pytest.fixture
def clean(pair: Pair, reference: LLMEngine) -> Iterator[Pair]:
    for e in (pair.producer, pair.consumer, reference):
        e.reset_prefix_cache()
    yield pair
    assert_idle(pair.producer, pair.consumer)


_ids = iter(range(10**6))


def rid(tag: str) -> str:
    return f"{tag}-{next(_ids)}"


def prompt(reference: LLMEngine, text: str) -> dict[str, list[int]]:
    ids = reference.tokenizer(text)["input_ids"]
    assert len(ids) >= LENGTH
    return {"prompt_token_ids": list(ids[:LENGTH])}


def expected(reference: LLMEngine, p: dict[str, list[int]]) -> list[int]:
    return list(run(reference, rid("ref"), p, GREEDY).outputs[0].token_ids)


def stat(engine: LLMEngine, name: str) -> Any:
    return engine.get_stats()[name]


def assert_no_copy_of(consumer: LLMEngine, producer: LLMEngine, block_ids: list[int]) -> None:
    """No block of the consumer's pool holds the bytes of one of the producer's ``block_ids``."""
    theirs, ours = producer.runner.kv_cache, consumer.runner.kv_cache
    for b in block_ids:
        same = (ours == theirs[:, :, b : b + 1]).flatten(3).all(dim=3).all(dim=1).all(dim=0)
        assert not same.any(), f"the consumer holds a copy of the producer's block {b}"


def claim(params: dict[str, Any], consumer: str, reader: str, op: str = "claim") -> dict[str, Any]:
    """A claim (or release) over the real control plane, as a consumer engine named ``consumer``."""
    request = {"op": op, "token": params["remote_lease_token"], "consumer": consumer, "reader": reader}
    return control_call(params["remote_address"], request, TIMEOUT, CONTROL_KEY)


def test_forged_block_ids_and_borrowed_tokens_read_nothing(clean: Pair, reference: LLMEngine) -> None:
    producer, consumer = clean.producer, clean.consumer
    victim, attacker = prompt(reference, VICTIM), prompt(reference, ATTACKER)
    want = expected(reference, attacker)
    victim_params = prefill(producer, rid("victim"), victim)
    attacker_params = prefill(producer, rid("attacker"), attacker)
    victim_blocks = victim_params["remote_block_ids"]
    assert set(victim_blocks).isdisjoint(attacker_params["remote_block_ids"])
    pulled, failed = stat(consumer, "kv_blocks_pulled"), stat(consumer, "kv_loads_failed")

    # 1. Its own lease, the victim's block ids: the producer's claim answer names other blocks.
    forged = {**attacker_params, "remote_block_ids": victim_blocks}
    out = run(consumer, rid("attack"), attacker, GREEDY, forged)
    assert out.outputs[0].token_ids == want and out.error is None
    assert stat(consumer, "kv_blocks_pulled") == pulled and stat(consumer, "kv_loads_failed") == failed + 1
    assert_no_copy_of(consumer, producer, victim_blocks)

    # The victim's lease was not touched: the victim's own pull still gets its KV.
    out = run(consumer, rid("victim"), victim, GREEDY, victim_params)
    assert out.outputs[0].token_ids == expected(reference, victim)
    assert stat(consumer, "kv_blocks_pulled") == pulled + 2

    # 2. The victim's whole params (say its token leaked) with the attacker's prompt and a
    # recomputed prompt_digest: the producer vouches for the victim's tokens, which are not
    # this prompt's, so nothing is read (and the exposed lease ends).
    consumer.reset_prefix_cache()
    victim_params = prefill(producer, rid("victim"), victim)
    borrowed = {**victim_params, "prompt_digest": prompt_digest(attacker["prompt_token_ids"])}
    out = run(consumer, rid("attack"), attacker, GREEDY, borrowed)
    assert out.outputs[0].token_ids == want
    assert stat(consumer, "kv_blocks_pulled") == pulled + 2 and stat(consumer, "kv_loads_failed") == failed + 2
    assert_no_copy_of(consumer, producer, victim_params["remote_block_ids"])
    wait_for_no_leases(producer)

    # What the consumer now caches under the attacker's tokens is the attacker's own KV.
    out = run(consumer, rid("plain"), attacker, GREEDY)
    assert out.num_cached_tokens == 32 and out.outputs[0].token_ids == want


def test_a_forged_lease_token_is_refused(clean: Pair, reference: LLMEngine) -> None:
    producer, consumer = clean.producer, clean.consumer
    attacker = prompt(reference, ATTACKER)
    params = prefill(producer, rid("p"), attacker)
    pulled, failed = stat(consumer, "kv_blocks_pulled"), stat(consumer, "kv_loads_failed")
    guessed = {**params, "remote_lease_token": secrets.token_urlsafe(32)}
    out = run(consumer, rid("guess"), attacker, GREEDY, guessed)
    assert out.outputs[0].token_ids == expected(reference, attacker)
    assert stat(consumer, "kv_blocks_pulled") == pulled and stat(consumer, "kv_loads_failed") == failed + 1
    with pytest.raises(KVTransferError, match="no lease has this token"):
        claim(guessed, "some-engine", "some-reader")
    # The real lease is intact and its token works.
    consumer.reset_prefix_cache()
    out = run(consumer, rid("real"), attacker, GREEDY, params)
    assert out.error is None and stat(consumer, "kv_blocks_pulled") == pulled + 2


def test_a_lease_belongs_to_the_first_consumer_that_claims_it(clean: Pair, reference: LLMEngine) -> None:
    producer, consumer = clean.producer, clean.consumer
    connector = consumer.kv_connector
    assert connector is not None
    me, my_reader = connector.engine_id, connector.transport.engine_id
    p = prompt(reference, ATTACKER)
    pulled = stat(consumer, "kv_blocks_pulled")

    # Another engine claimed it first: this consumer's claim is refused, it computes the prompt.
    params = prefill(producer, rid("p"), p)
    granted = claim(params, "other-engine", "other-reader")
    assert granted["block_ids"] == params["remote_block_ids"] and granted["num_tokens"] == LENGTH
    out = run(consumer, rid("late"), p, GREEDY, params)
    assert out.outputs[0].token_ids == expected(reference, p) and stat(consumer, "kv_blocks_pulled") == pulled
    with pytest.raises(KVTransferError, match="claimed by another consumer"):
        claim(params, me, my_reader, op="release")
    assert stat(producer, "num_kv_leases") == 1
    assert claim(params, "other-engine", "other-reader", op="release")["held"] is True

    # This consumer claimed it first: another engine is refused, this one's pull goes through.
    consumer.reset_prefix_cache()
    params = prefill(producer, rid("p"), p)
    claim(params, me, my_reader)
    with pytest.raises(KVTransferError, match="claimed by another consumer"):
        claim(params, "other-engine", my_reader)
    out = run(consumer, rid("first"), p, GREEDY, params)
    assert out.error is None and stat(consumer, "kv_blocks_pulled") == pulled + 2
    wait_for_no_leases(producer)


def _raw_call(address: str, message: dict[str, Any]) -> dict[str, Any]:
    zmq = import_zmq()
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(json.dumps(message).encode())
        assert sock.poll(int(TIMEOUT * 1000))
        reply: dict[str, Any] = json.loads(sock.recv())
        return reply
    finally:
        sock.close()


def test_the_control_plane_refuses_peers_without_the_secret(clean: Pair, reference: LLMEngine) -> None:
    producer = clean.producer
    params = prefill(producer, rid("p"), prompt(reference, ATTACKER))
    address = params["remote_address"]
    lease = {"token": params["remote_lease_token"], "consumer": "intruder", "reader": "intruder"}
    # No secret: a plain request gets a refusal and nothing else.
    for request in ({"op": "metadata"}, {"op": "claim", **lease}, {"op": "release", **lease}):
        reply = _raw_call(address, request)
        assert reply["ok"] is False and "not authenticated" in reply["error"]
        assert set(reply) == {"ok", "error"}
    # The wrong secret: refused (a bad MAC), for every op.
    wrong = derive_key(b"another-secret-of-enough-length", "control")
    for request in ({"op": "metadata"}, {"op": "claim", **lease}):
        with pytest.raises(KVTransferError, match="bad MAC"):
            control_call(address, request, TIMEOUT, wrong)
    # A replayed message (a valid one seen on the wire) finds its nonce spent.
    nonce = _raw_call(address, {"op": "hello"})["nonce"]
    envelope = sign_request(CONTROL_KEY, nonce, {"op": "metadata"})
    assert "metadata" in json.loads(_raw_call(address, envelope)["body"])
    replayed = _raw_call(address, envelope)
    assert replayed["ok"] is False and "already used nonce" in replayed["error"] and "body" not in replayed
    # Nothing above touched the lease: the real claim still gets it, then ends it.
    assert stat(producer, "num_kv_leases") == 1
    assert claim(params, "engine", "reader", op="release")["held"] is True


def test_a_consumer_refuses_replies_not_signed_with_the_secret() -> None:
    # A "producer" at an address from the params that does not hold the secret (an impostor,
    # or another deployment): its answers are refused, whatever they say.
    impostor = ControlServer("127.0.0.1", 0, {"metadata": lambda r: {"ok": True, "metadata": "{}"}}, b"x" * 32)
    try:
        with pytest.raises(KVTransferError, match="bad MAC"):
            control_call(impostor.address, {"op": "metadata"}, TIMEOUT, CONTROL_KEY)
    finally:
        impostor.close()
    zmq = import_zmq()
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")

    def answer_everything() -> None:  # a nonce, then a forged "ok" with a made-up MAC
        for reply in (
            {"ok": True, "nonce": "0" * 32},  # of a nonce's form: the forged MAC is what is refused
            {"body": json.dumps({"ok": True, "metadata": "{}"}), "mac": "0" * 64},
        ):
            if not rogue.poll(int(TIMEOUT * 1000)):
                return
            frames = rogue.recv_multipart()
            rogue.send_multipart([frames[0], b"", json.dumps(reply).encode()])

    thread = threading.Thread(target=answer_everything, daemon=True)
    thread.start()
    try:
        with pytest.raises(KVTransferError, match="not authenticated"):
            control_call(f"tcp://127.0.0.1:{port}", {"op": "metadata"}, TIMEOUT, CONTROL_KEY)
    finally:
        thread.join(TIMEOUT)
        rogue.close()


def test_an_engine_without_a_secret_does_not_start(engine_kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match=SECRET_ENV):
        LLMEngine(**engine_kw, kv_transfer_config={"role": "producer", "transport": "gloo"})
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        KVTransferConfig(auth_secret="short")
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        KVTransferConfig().secret()
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert KVTransferConfig().secret() == SECRET.encode()
    assert SECRET not in repr(KVTransferConfig(auth_secret=SECRET))


def test_the_gloo_holder_serves_only_claimed_blocks_to_signed_requests(clean: Pair, reference: LLMEngine) -> None:
    if clean.kind != "gloo":
        pytest.skip("NIXL reads are one-sided: the holder cannot refuse them")
    producer, consumer = clean.producer, clean.consumer
    connector = consumer.kv_connector
    assert connector is not None
    transport = connector.transport
    params = prefill(producer, rid("p"), prompt(reference, ATTACKER))
    lease_blocks = params["remote_block_ids"]
    outside = max(lease_blocks) + 5
    peer = connector._ensure_peer(params["remote_address"])  # the pull thread is idle
    targets = [62, 63]  # free and uncached (the prefix cache was reset): nobody reads them

    def read(remote: list[int]) -> None:
        transport.wait(transport.read_blocks(peer, remote, targets[: len(remote)]), timeout=TIMEOUT)

    with pytest.raises(KVTransferError, match="granted"):
        read(lease_blocks[:1])  # not claimed yet
    claim(params, connector.engine_id, transport.engine_id)
    with pytest.raises(KVTransferError, match="granted"):
        read([lease_blocks[0], outside])  # one block outside the lease
    read(lease_blocks[:2])
    theirs, ours = producer.runner.kv_cache, consumer.runner.kv_cache
    assert torch.equal(ours[:, :, targets], theirs[:, :, lease_blocks[:2]])
    # A request slipped into the store without the deployment's key (anyone who reaches the
    # store could write one under this reader's name) is refused too.
    key, transport._auth_key = transport._auth_key, None  # type: ignore[attr-defined]
    try:
        with pytest.raises(KVTransferError, match="not signed"):
            read(lease_blocks[:1])
    finally:
        transport._auth_key = key  # type: ignore[attr-defined]
    assert claim(params, connector.engine_id, transport.engine_id, op="release")["held"] is True
    with pytest.raises(KVTransferError, match="granted"):
        read(lease_blocks[:1])  # released: the grant is gone
    consumer.reset_prefix_cache()


def test_the_transfer_sockets_listen_on_loopback_only(pair: Pair) -> None:
    # Configured on 127.0.0.1: the control socket, and for gloo the store (which torch's own
    # TCPStore would open on every interface) and both ranks' pairs; for NIXL, UCX's sockets
    # (on every device by default; the producer limits UCX to lo, and the consumer built after
    # it in this process inherits that).
    assert len(pair.new_listeners) >= 3, pair.new_listeners
    assert {ip for ip, _ in pair.new_listeners} == {"127.0.0.1"}, pair.new_listeners
    producer = pair.producer.kv_connector
    assert producer is not None and producer.address is not None
    assert ("127.0.0.1", int(producer.address.rsplit(":", 1)[1])) in pair.new_listeners
    if pair.kind == "gloo":
        init_method = producer.config.gloo_init_method
        assert init_method is not None
        assert ("127.0.0.1", int(init_method.rsplit(":", 1)[1])) in pair.new_listeners
