"""The attack suite's harness: an attack runs against a real server while an honest client
uses it, and afterwards the server must still tell the truth and hold no lost block.

    attacks = Attacks(server.url)              # one per module, after its server started
    report = attacks.run("stop-strings", lambda: post(...))
    assert report.result.status_code == 400    # the attacker got a clear 4xx (or a bounded answer)

:meth:`Attacks.run` checks, for every attack:

1. the attack (a callable that sends the hostile request or packets and returns what it got
   back) runs on its own thread; after ``settle`` seconds, while it is in flight, the honest
   client sends its request (``honest_rounds`` times);
2. the honest request completes and its text is exactly the text it had before any attack
   (greedy, measured once per module when the harness is made);
3. the attack ends within ``attack_timeout`` (the server gave a bounded answer);
4. ``/health`` says ``ok`` (or, for an attack that kills a thread the server needs, what
   the test expects: ``expect_health``), every engine's requests drain, and each engine's
   ``POST /dev/check_invariants`` (the server runs with ``PAGEDKV_SERVER_DEV_MODE=1``) finds
   the KV bookkeeping sound and no block in use: none was lost.

The honest client's latency under attack and at rest is recorded on every report. The suite
asserts nothing about time (a shared 2-core machine is not a stopwatch); its benchmark mode
(``pytest tests/adversarial --attack-bench [--attack-bench-out FILE]``, or
``python benches/bench_attacks.py``) repeats the honest request and prints the ratio of its
median latency under each attack to its median at rest.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx

T = TypeVar("T")

# Every engine a test starts serves its development endpoints (POST /dev/check_invariants).
DEV_MODE_ENV = {"PAGEDKV_SERVER_DEV_MODE": "1"}
# The honest request: greedy, short, on a prompt whose next tokens the model is sure of.
HONEST_PROMPT = "The capital of France is"
HONEST_MAX_TOKENS = 8
TIMEOUT = 120.0

# Reports of this pytest process, for the benchmark mode's table (tests/adversarial/conftest.py).
REPORTS: list[AttackReport[Any]] = []


@dataclass
class AttackReport(Generic[T]):
    """What one attack did: the attacker's result, the honest client's latencies (seconds)
    under it, and its median latency at rest."""

    name: str
    result: T
    honest_s: list[float]
    quiet_s: float
    health: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Median honest latency under the attack over the median at rest."""
        return statistics.median(self.honest_s) / self.quiet_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "attack": self.name,
            "honest_median_s": statistics.median(self.honest_s),
            "quiet_median_s": self.quiet_s,
            "ratio": self.ratio,
            "rounds": len(self.honest_s),
        }


class Attacks:
    """Runs attacks against the server at ``url`` (the router's, for a disaggregated pair);
    ``engines``: the URLs whose ``/dev/check_invariants`` must find no lost block (default:
    ``url`` itself). ``headers``: what the honest client and the checks send (an API key).
    ``honest_rounds``: honest requests per attack (the benchmark mode sends more).
    ``honest_prompt``: the honest client's prompt; ``honest_fields``: called before each honest
    request for more fields of its body (e.g. a fresh ``cache_salt``, so that every honest
    request computes, or pulls, its prompt's KV anew: its text does not change)."""

    def __init__(
        self,
        url: str,
        *,
        engines: Sequence[str] | None = None,
        headers: dict[str, str] | None = None,
        engine_headers: dict[str, str] | None = None,
        honest_rounds: int = 1,
        quiet_rounds: int = 1,
        honest_prompt: str = HONEST_PROMPT,
        honest_fields: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.url = url
        self.honest_prompt = honest_prompt
        self.honest_fields = honest_fields
        self.engines = list(engines) if engines is not None else [url]
        self.headers = dict(headers or {})
        self.engine_headers = dict(engine_headers if engine_headers is not None else self.headers)
        self.honest_rounds = honest_rounds
        self.client = httpx.Client(timeout=TIMEOUT, headers=self.headers)
        # The first request pays one-time costs (lazy imports, first allocations): not "at rest".
        self.honest_text, _ = self.honest_request()
        quiet = [self.honest_request() for _ in range(max(1, quiet_rounds))]
        assert all(text == self.honest_text for text, _ in quiet), quiet
        self.quiet_s = statistics.median(seconds for _, seconds in quiet)

    def honest_request(self) -> tuple[str, float]:
        """One honest greedy completion: its text and how long it took."""
        body = {"prompt": self.honest_prompt, "max_tokens": HONEST_MAX_TOKENS, "temperature": 0.0}
        if self.honest_fields is not None:
            body.update(self.honest_fields())
        start = time.perf_counter()
        r = self.client.post(self.url + "/v1/completions", json=body)
        seconds = time.perf_counter() - start
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"]), seconds

    def run(
        self,
        name: str,
        attack: Callable[[], T],
        *,
        settle: float = 0.3,
        attack_timeout: float = 120.0,
        expect_health: str = "ok",
        drain_timeout: float = 60.0,
    ) -> AttackReport[T]:
        """Runs ``attack`` beside the honest client and checks what the module docs list."""
        outcome: dict[str, Any] = {}

        def attacker() -> None:
            try:
                outcome["result"] = attack()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
                outcome["error"] = exc

        thread = threading.Thread(target=attacker, name=f"attack-{name}", daemon=True)
        thread.start()
        thread.join(settle)
        honest: list[float] = []
        for _ in range(self.honest_rounds):
            text, seconds = self.honest_request()
            assert text == self.honest_text, f"under {name!r} the honest client got {text!r}, not {self.honest_text!r}"
            honest.append(seconds)
        thread.join(attack_timeout)
        assert not thread.is_alive(), f"the {name!r} attack got no answer within {attack_timeout} s"
        if "error" in outcome:
            raise outcome["error"]
        health = self.check_health(expect_health)
        self.check_no_block_lost(drain_timeout)
        report = AttackReport(name=name, result=outcome["result"], honest_s=honest, quiet_s=self.quiet_s, health=health)
        REPORTS.append(report)
        return report

    def check_health(self, expect: str = "ok") -> dict[str, Any]:
        """``/health``'s JSON, which must say ``expect`` (200 for ok, else 503)."""
        r = self.client.get(self.url + "/health")
        body = r.json() if r.content else {}
        status = body.get("status", "ok" if r.status_code == 200 else None)
        assert status == expect, f"/health says {status!r} ({r.status_code}: {r.text[:500]}), expected {expect!r}"
        assert (r.status_code == 200) == (expect == "ok"), r.text
        return dict(body)

    def invariants(self, engine: str) -> dict[str, int]:
        r = self.client.post(engine + "/dev/check_invariants", headers=self.engine_headers)
        assert r.status_code == 200, f"{engine}: {r.status_code} {r.text[:2000]}"
        return dict(r.json())

    def check_no_block_lost(self, timeout: float = 60.0) -> None:
        """Every engine drains (no request left) within ``timeout``, its bookkeeping checks
        out, and no block is in use but by a KV lease (a producer's, released or expired by
        the protocol, not by us)."""
        for engine in self.engines:
            deadline = time.monotonic() + timeout
            while True:
                state = self.invariants(engine)
                idle = state["num_unfinished_requests"] == 0 and state["num_kv_reservations"] == 0
                if idle and (state["num_used_blocks"] == 0 or state["num_kv_leases"] > 0):
                    break
                assert time.monotonic() < deadline, f"{engine} did not drain in {timeout} s: {state}"
                time.sleep(0.1)

    def close(self) -> None:
        self.client.close()


def post_json(
    url: str, body: Any, *, timeout: float = TIMEOUT, headers: dict[str, str] | None = None
) -> httpx.Response:
    """A POST of ``body`` (JSON-encoded unless it is bytes already)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        url, content=content, headers={"Content-Type": "application/json", **(headers or {})}, timeout=timeout
    )


def zmtp_claim_frame(address: str, size: int, timeout: float = 10.0) -> bool:
    """Connects to the ZMQ socket at ``tcp://host:port`` as a DEALER speaking ZMTP 3.0 by hand,
    sends an empty frame, then the header of a frame of ``size`` bytes (never the bytes), and
    returns whether the server closed the connection within ``timeout`` (it does when ``size``
    is over its ``MAXMSGSIZE``: cut off before anything is buffered).

    By hand, not with pyzmq: libzmq 4.3.5 aborts the *sending* process (``Resource temporarily
    unavailable (src/session_base.cpp:233)``) when a socket is closed while the peer drops the
    connection in the middle of its multipart message; an attacker's process may crash, a test's
    must not."""
    import socket
    import struct

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
    prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    ready = b"\x05READY" + prop
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
        sock.sendall(greeting + bytes([0x04, len(ready)]) + ready)
        sock.sendall(b"\x01\x00" + b"\x02" + struct.pack(">Q", size) + b"x" * min(size, 1024))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not sock.recv(65536):
                    return True  # closed by the server
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


def error_of(r: httpx.Response, status: int | tuple[int, ...]) -> dict[str, Any]:
    """OpenAI's error body of a response whose status must be ``status`` (one of them)."""
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, f"{r.status_code}: {r.text[:2000]}"
    error = r.json()["error"]
    assert error["message"] and error["type"] and isinstance(error["code"], str), error
    return dict(error)
