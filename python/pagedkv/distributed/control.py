"""The control plane of KV transfer: a producer's small ZMQ request/reply service.

A producer binds a ROUTER socket at ``kv_transfer_config.control_host:control_port`` (only
there) and answers, from one daemon thread, JSON requests:

- ``{"op": "metadata"}`` → ``{"ok": true, "metadata": <transport metadata, text>,
  "fingerprint": {...}}``: the handshake. The consumer hands ``metadata`` to its transport's
  ``add_peer`` (which refuses another layout) and compares ``fingerprint`` (model and KV
  format) with its own.
- ``{"op": "claim", ...}`` / ``{"op": "release", ...}``: a lease (see
  :mod:`pagedkv.distributed.connector`).

Bad requests get ``{"ok": false, "error": ...}``; the service never dies of one. The data itself
never goes through here (that is the transport's job).

**Authentication.** Every engine of a deployment holds one shared secret
(``KVTransferConfig.secret()``); the key used here is derived from it. A call is two round
trips on one REQ socket:

1. ``{"op": "hello"}`` → ``{"ok": true, "nonce": N}``: a fresh random server nonce, usable once
   within ``NONCE_SECONDS``;
2. ``{"nonce": N, "cnonce": C, "body": "<request JSON>", "mac": HMAC(key, req|N|C|body)}`` →
   ``{"body": "<reply JSON>", "mac": HMAC(key, rep|N|C|body)}``.

The server answers a request only if its MAC verifies and its nonce is one it issued and has
not seen used (a replayed message finds its nonce spent); the client accepts a reply only if
its MAC verifies under its own fresh ``C`` (a reply from someone without the secret, or one
replayed from another call, is refused). A peer without the secret gets nonces and refusals,
nothing else: no metadata (which, for NIXL, is the capability to read the registered memory),
no lease. Messages are authenticated, not encrypted: nothing secret travels here except the
lease tokens, which are single-consumer capabilities (see the connector).

A consumer calls with :func:`control_call`: one REQ socket per call (a REQ socket is unusable
after a timeout), loopback round trips well under a millisecond, linger 0 so a dead peer never
blocks shutdown.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedkv.errors import ConfigError, KVTransferError

__all__ = ["ControlServer", "control_call", "import_zmq", "sign_request"]

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the serving thread looks at its stop flag
NONCE_SECONDS = 60.0  # how long an issued nonce may be used (a call takes milliseconds)
MAX_NONCES = 4096  # outstanding nonces; the oldest go first (a flood of hellos costs memory, not service)


def import_zmq() -> Any:
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - the serve extra brings it
        raise ConfigError("KV transfer needs pyzmq: pip install 'pagedkv[serve]'") from e
    return zmq


def _mac(key: bytes, direction: bytes, nonce: str, cnonce: str, body: str) -> str:
    message = b"\0".join((direction, nonce.encode(), cnonce.encode(), body.encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign_request(key: bytes, nonce: str, request: dict[str, Any]) -> dict[str, Any]:
    """The authenticated envelope of ``request`` under server nonce ``nonce`` (a fresh client
    nonce inside): what :func:`control_call` sends in its second round trip."""
    body = json.dumps(request)
    cnonce = secrets.token_hex(16)
    return {"nonce": nonce, "cnonce": cnonce, "body": body, "mac": _mac(key, b"req", nonce, cnonce, body)}


class ControlServer:
    """Answers authenticated control requests with ``handlers[op](request) -> reply dict`` on a
    daemon thread. ``address`` is the bound ``tcp://host:port`` (port 0 picks a free one);
    ``key`` is the control key derived from the deployment's secret."""

    def __init__(
        self, host: str, port: int, handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]], key: bytes
    ) -> None:
        zmq = import_zmq()
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise ConfigError(f"cannot bind the KV transfer control socket on {host}:{port}: {e}") from e
        self.address = f"tcp://{host}:{port}"
        self._handlers = handlers
        self._key = key
        # Issued and not yet used nonces -> issue time (only the serving thread touches it).
        self._nonces: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagedkv-kv-control", daemon=True)
        self._thread.start()

    def _new_nonce(self) -> dict[str, Any]:
        now = time.monotonic()
        while self._nonces and (
            len(self._nonces) >= MAX_NONCES or now - next(iter(self._nonces.values())) > NONCE_SECONDS
        ):
            self._nonces.popitem(last=False)
        nonce = secrets.token_hex(16)
        self._nonces[nonce] = now
        return {"ok": True, "nonce": nonce}

    def _open(self, envelope: dict[str, Any]) -> dict[str, Any] | str:
        """The request inside a verified envelope, or why it is refused. A nonce is spent by
        any attempt that names it, so a forger gets one guess per nonce it asked for."""
        nonce, cnonce, body, mac = (envelope.get(k) for k in ("nonce", "cnonce", "body", "mac"))
        if not (isinstance(nonce, str) and isinstance(cnonce, str) and isinstance(body, str) and isinstance(mac, str)):
            return "not authenticated: send hello, then a signed request"
        issued = self._nonces.pop(nonce, None)
        if issued is None or time.monotonic() - issued > NONCE_SECONDS:
            return "not authenticated: unknown, expired or already used nonce (a replay?)"
        if not hmac.compare_digest(mac, _mac(self._key, b"req", nonce, cnonce, body)):
            return "not authenticated: bad MAC (do the engines share one kv transfer secret?)"
        try:
            request = json.loads(body)
        except ValueError:
            return "the request is not JSON"
        return request if isinstance(request, dict) else "the request is not a JSON object"

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        if request.get("op") not in self._handlers:
            return {"ok": False, "error": f"unknown op; known: {sorted(self._handlers)}"}
        try:
            return self._handlers[request["op"]](request)
        except Exception as e:  # a handler's failure is this request's answer, not the service's end
            logger.warning("KV control request %r failed", request.get("op"), exc_info=True)
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    def _answer(self, payload: bytes) -> dict[str, Any]:
        try:
            envelope = json.loads(payload)
        except ValueError:
            return {"ok": False, "error": "the request is not JSON"}
        if not isinstance(envelope, dict):
            return {"ok": False, "error": "the request is not a JSON object"}
        if envelope.get("op") == "hello":
            return self._new_nonce()
        request = self._open(envelope)
        if isinstance(request, str):
            logger.warning("KV control: refused a request: %s", request)
            return {"ok": False, "error": request}
        body = json.dumps(self._handle(request))
        return {"body": body, "mac": _mac(self._key, b"rep", envelope["nonce"], envelope["cnonce"], body)}

    def _serve(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            # ROUTER frames from a REQ peer: [identity, b"", payload].
            if len(frames) != 3:
                continue
            reply = json.dumps(self._answer(frames[2])).encode()
            self._sock.send_multipart([frames[0], b"", reply])
        self._sock.close()

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=5)
            self._ctx.term()


def _round_trip(zmq: Any, sock: Any, message: dict[str, Any], deadline: float, what: str) -> Any:
    sock.send(json.dumps(message).encode())
    if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
        raise KVTransferError(f"{what}: no answer in time")
    try:
        return json.loads(sock.recv())
    except ValueError as e:
        raise KVTransferError(f"{what}: the answer is not JSON") from e


def control_call(address: str, request: dict[str, Any], timeout: float, key: bytes) -> dict[str, Any]:
    """One authenticated request/reply with the producer at ``address`` (see the module docs);
    KVTransferError when it does not answer within ``timeout`` seconds, answers ``ok: false``
    or sends a reply that is not authenticated under ``key``."""
    zmq = import_zmq()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    what = f"KV control call {request.get('op')!r} to {address}"
    deadline = time.monotonic() + timeout
    try:
        sock.connect(address)
        hello = _round_trip(zmq, sock, {"op": "hello"}, deadline, what)
        if not isinstance(hello, dict) or not isinstance(hello.get("nonce"), str):
            raise KVTransferError(f"{what}: no nonce in the answer to hello: {hello!r:.200}")
        envelope = sign_request(key, hello["nonce"], request)
        answer = _round_trip(zmq, sock, envelope, deadline, what)
    except zmq.ZMQError as e:
        raise KVTransferError(f"{what} failed: {e}") from e
    finally:
        sock.close()
    body, mac = (answer.get("body"), answer.get("mac")) if isinstance(answer, dict) else (None, None)
    if not isinstance(body, str) or not isinstance(mac, str):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise KVTransferError(f"{what}: refused without authentication: {error!r:.200}")
    if not hmac.compare_digest(mac, _mac(key, b"rep", envelope["nonce"], envelope["cnonce"], body)):
        raise KVTransferError(f"{what}: the reply is not authenticated (another secret, or not a pagedkv producer)")
    reply = json.loads(body)
    if not isinstance(reply, dict) or not reply.get("ok"):
        error = reply.get("error") if isinstance(reply, dict) else reply
        raise KVTransferError(f"the KV producer at {address} refused {request.get('op')!r}: {error}")
    return reply
