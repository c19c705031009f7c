"""What the disaggregation tests share: the KV transports they run over (NIXL where its wheel is
installed, the ``nixl`` extra, host memory on this machine; gloo, torch.distributed,
everywhere), and a producer / consumer pair of in-process engines with the helpers that drive
them (the engine API is the same as behind a server)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import pagedkv.distributed.connector as connector_module
from pagedkv import LLMEngine, SamplingParams
from pagedkv.distributed.kv_transport import nixl_available
from pagedkv.engine.outputs import RequestOutput
from pagedkv.server.launch import free_port

TRANSPORTS = [
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")),
    "gloo",
]

TIMEOUT = 60.0
# The deployment's shared secret (kv_transfer_config.auth_secret): every engine of a pair has it.
SECRET = "test-kv-transfer-secret-0123456789"


def make_pair(transport: str, engine: dict[str, Any], **config: Any) -> tuple[LLMEngine, LLMEngine]:
    """A producer and a consumer engine built with ``engine`` (LLMEngine keywords) and extra
    ``kv_transfer_config`` keys. For gloo the two form one group, so the consumer (rank 0, the
    store) is built in a thread and waits in the group's rendezvous while the producer is
    built; the producer's model loads only once the consumer's has (transformers' loading is
    not thread-safe)."""
    common = {"transport": transport, "auth_secret": SECRET, **config}
    consumer_config = {"role": "consumer", "transfer_timeout": 20.0, **common}
    if transport != "gloo":
        producer = LLMEngine(**engine, kv_transfer_config={"role": "producer", **common})
        return producer, LLMEngine(**engine, kv_transfer_config=consumer_config)
    gloo = {"gloo_world_size": 2, "gloo_init_method": f"tcp://127.0.0.1:{free_port()}", "connect_timeout": TIMEOUT}
    at_rendezvous = threading.Event()
    real_make_transport = connector_module.make_transport

    def make_transport(*args: Any, **kwargs: Any) -> Any:
        at_rendezvous.set()
        return real_make_transport(*args, **kwargs)

    box: list[Any] = []

    def build_consumer() -> None:
        try:
            box.append(LLMEngine(**engine, kv_transfer_config={**consumer_config, "gloo_rank": 0, **gloo}))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box.append(e)
        at_rendezvous.set()

    connector_module.make_transport = make_transport  # type: ignore[assignment]
    try:
        thread = threading.Thread(target=build_consumer)
        thread.start()
        assert at_rendezvous.wait(TIMEOUT)
    finally:
        connector_module.make_transport = real_make_transport  # type: ignore[assignment]
    producer = LLMEngine(**engine, kv_transfer_config={"role": "producer", **common, "gloo_rank": 1, **gloo})
    thread.join(TIMEOUT)
    if isinstance(box[0], BaseException):
        raise box[0]
    return producer, box[0]


def run(engine: LLMEngine, rid: str, prompt: Any, params: SamplingParams, kv: Any = None) -> RequestOutput:
    """Adds one request and steps until it ends; its final output."""
    engine.add_request(rid, prompt, params, kv_transfer_params=kv)
    deadline = time.monotonic() + TIMEOUT
    final = None
    while final is None:
        assert time.monotonic() < deadline, f"{rid} did not finish"
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def prefill(producer: LLMEngine, rid: str, prompt: Any) -> dict[str, Any]:
    """The producer's ``kv_transfer_params`` for ``prompt`` (its KV held under a lease)."""
    out = run(producer, rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), {"do_remote_decode": True})
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def drain(engine: LLMEngine) -> None:
    deadline = time.monotonic() + TIMEOUT
    while engine.has_unfinished_requests() or (engine.kv_connector is not None and engine.kv_connector.loads):
        assert time.monotonic() < deadline
        engine.step()


def assert_idle(*engines: LLMEngine) -> None:
    """No block used, no lease, no reservation left on any of ``engines``."""
    for e in engines:
        drain(e)
        e.poll_kv_transfer()
        stats = e.get_stats()
        assert stats["num_used_blocks"] == 0, stats
        assert stats["num_kv_leases"] == 0 and stats["num_kv_reservations"] == 0, stats
        e.scheduler.check_invariants()


def wait_for_no_leases(producer: LLMEngine) -> None:
    """Waits until the producer holds no lease (a release arrives from the consumer's thread)."""
    deadline = time.monotonic() + TIMEOUT
    while producer.get_stats()["num_kv_leases"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
