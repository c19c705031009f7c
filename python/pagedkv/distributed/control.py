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

**Bounds.** Whoever reaches the socket can send anything, before any authentication, so every
message is taken apart within bounds and by type: a frame larger than ``MAX_REQUEST_BYTES``
disconnects its sender (ZMQ ``MAXMSGSIZE``), a message of more than 3 frames is dropped, JSON
nested deeper than ``MAX_JSON_DEPTH`` or that is not JSON is refused
(:func:`pagedkv.bounded_json.loads_bounded`), and the envelope's nonces and MAC must be
lowercase hex of their exact length before ``hmac.compare_digest`` sees them (it raises
``TypeError`` on a non-ASCII str). Each message is handled under its own ``except Exception``:
whatever one does is that message's answer (or none), recorded in the engine's
:class:`~pagedkv.background.BackgroundThreads` (counted, logged at a bounded rate, the metric
``pagedkv:background_errors``), and the thread goes on to the next; a thread that dies anyway
makes the server's ``/health`` degraded. A caller (:func:`control_call`) takes replies apart the
same way (up to ``MAX_REPLY_BYTES``: the handshake carries the transport's metadata) and raises
nothing but ``KVTransferError`` for anything a producer, or an impostor, sends back.

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
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedkv.background import BackgroundThreads
from pagedkv.bounded_json import describe, loads_bounded
from pagedkv.errors import ConfigError, InvalidArgumentError, KVTransferError

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "THREAD_NAME",
    "ControlServer",
    "control_call",
    "import_zmq",
    "sign_request",
]

logger = logging.getLogger(__name__)

THREAD_NAME = "pagedkv-kv-control"  # the serving thread, as BackgroundThreads and /health name it
_POLL_MS = 100  # how often the serving thread looks at its stop flag
NONCE_SECONDS = 60.0  # how long an issued nonce may be used (a call takes milliseconds)
MAX_NONCES = 4096  # outstanding nonces; the oldest go first (a flood of hellos costs memory, not service)
# Bounds of a message (docs/limits.md). A request is a few hundred bytes (a signed claim); a
# reply may carry the transport's metadata (NIXL's agent description: kilobytes).
MAX_REQUEST_BYTES = 64 << 10
MAX_REPLY_BYTES = 16 << 20
MAX_JSON_DEPTH = 16  # the deepest control message nests 3 (a reply's fingerprint)
_MAX_FRAMES = 3  # ROUTER frames from a REQ peer: [identity, b"", payload]
_NONCE = re.compile(r"[0-9a-f]{32}")  # secrets.token_hex(16)
_MAC = re.compile(r"[0-9a-f]{64}")  # an HMAC-SHA256 hexdigest


def import_zmq() -> Any:
    """The ``zmq`` module; ConfigError naming the extra to install when it is missing."""
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - the serve extra brings it
        raise ConfigError("KV transfer needs pyzmq: pip install 'pagedkv[serve]'") from e
    return zmq


def _mac(key: bytes, direction: bytes, nonce: str, cnonce: str, body: str) -> str:
    # surrogatepass: a body from JSON may hold a lone surrogate ("\\ud800"); it must get a MAC
    # (and so a refusal or an answer), not a UnicodeEncodeError.
    parts = (nonce, cnonce, body)
    message = b"\0".join((direction, *(p.encode("utf-8", "surrogatepass") for p in parts)))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _is(pattern: re.Pattern[str], value: object) -> bool:
    """``value`` is a str of ``pattern``'s exact form (ASCII: safe for ``hmac.compare_digest``)."""
    return isinstance(value, str) and pattern.fullmatch(value) is not None


def _text(value: object) -> str:
    """A peer's error text for a message: a str as it is (cut at 300 characters), anything
    else described (:func:`describe`)."""
    return value[:300] if isinstance(value, str) else describe(value)


def sign_request(key: bytes, nonce: str, request: dict[str, Any]) -> dict[str, Any]:
    """The authenticated envelope of ``request`` under server nonce ``nonce`` (a fresh client
    nonce inside): what :func:`control_call` sends in its second round trip."""
    body = json.dumps(request)
    cnonce = secrets.token_hex(16)
    return {"nonce": nonce, "cnonce": cnonce, "body": body, "mac": _mac(key, b"req", nonce, cnonce, body)}


def _recv_message(zmq: Any, sock: Any) -> list[bytes] | None:
    """One whole multipart message from ``sock`` (whose first frame is ready), or None when it
    has more than ``_MAX_FRAMES`` frames: those past the bound are read and dropped, never kept."""
    frames = [sock.recv(zmq.NOBLOCK)]
    too_many = False
    while sock.getsockopt(zmq.RCVMORE):
        part = sock.recv(zmq.NOBLOCK)
        if len(frames) < _MAX_FRAMES:
            frames.append(part)
        else:
            too_many = True
    return None if too_many else frames


class ControlServer:
    """Answers authenticated control requests with ``handlers[op](request) -> reply dict`` on a
    daemon thread. ``address`` is the bound ``tcp://host:port`` (port 0 picks a free one);
    ``key`` is the control key derived from the deployment's secret. ``background``: where the
    serving thread runs and reports the messages it refused or survived (the engine's
    :class:`BackgroundThreads`; a private one by default)."""

    def __init__(
        self,
        host: str,
        port: int,
        handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]],
        key: bytes,
        *,
        background: BackgroundThreads | None = None,
    ) -> None:
        zmq = import_zmq()
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A larger frame disconnects its sender before it is buffered whole (bounded memory).
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
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
        self.background = background if background is not None else BackgroundThreads()
        self._thread = self.background.start(THREAD_NAME, self._serve)

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
        any attempt that names it, so a forger gets one guess per nonce it asked for. Every
        field's type and form is checked before it is used: the MAC is compared only as
        lowercase hex of its length."""
        nonce, cnonce, body, mac = (envelope.get(k) for k in ("nonce", "cnonce", "body", "mac"))
        if not (_is(_NONCE, nonce) and _is(_NONCE, cnonce) and isinstance(body, str) and _is(_MAC, mac)):
            return "not authenticated: send hello, then a signed request (hex nonces and MAC)"
        assert isinstance(nonce, str) and isinstance(cnonce, str) and isinstance(mac, str)
        issued = self._nonces.pop(nonce, None)
        if issued is None or time.monotonic() - issued > NONCE_SECONDS:
            return "not authenticated: unknown, expired or already used nonce (a replay?)"
        if not hmac.compare_digest(mac, _mac(self._key, b"req", nonce, cnonce, body)):
            return "not authenticated: bad MAC (do the engines share one kv transfer secret?)"
        try:
            request = loads_bounded(body, max_bytes=MAX_REQUEST_BYTES, max_depth=MAX_JSON_DEPTH, what="the request")
        except InvalidArgumentError as e:
            return str(e)
        return request if isinstance(request, dict) else "the request is not a JSON object"

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if not isinstance(op, str) or op not in self._handlers:
            return {"ok": False, "error": f"unknown op; known: {sorted(self._handlers)}"}
        try:
            return self._handlers[op](request)
        except Exception as e:  # a handler's failure is this request's answer, not the service's end
            self.background.record_error(THREAD_NAME, e, f"a {op!r} request")
            return {"ok": False, "error": f"{type(e).__name__}: {_text(str(e))}"}

    def _refuse(self, why: str) -> dict[str, Any]:
        """The answer to a message refused before any handler ran; counted as a survived error."""
        self.background.record_error(THREAD_NAME, KVTransferError(why), "a control message")
        return {"ok": False, "error": why}

    def _answer(self, payload: bytes) -> dict[str, Any]:
        """The reply to one message's payload (never raises for any ``payload``)."""
        try:
            envelope = loads_bounded(payload, max_bytes=MAX_REQUEST_BYTES, max_depth=MAX_JSON_DEPTH)
        except InvalidArgumentError as e:
            return self._refuse(str(e))
        if not isinstance(envelope, dict):
            return self._refuse("the message is not a JSON object")
        if envelope.get("op") == "hello":
            return self._new_nonce()
        request = self._open(envelope)
        if isinstance(request, str):
            return self._refuse(request)
        body = json.dumps(self._handle(request))
        return {"body": body, "mac": _mac(self._key, b"rep", envelope["nonce"], envelope["cnonce"], body)}

    def _serve_one(self) -> None:
        """Reads one message and answers it (a message that is not ``[identity, b"", payload]``
        gets no answer: a REQ peer never sends one)."""
        zmq = self._zmq
        frames = _recv_message(zmq, self._sock)
        if frames is None or len(frames) != _MAX_FRAMES or frames[1] != b"":
            self._refuse("a message that is not [identity, empty, payload] (not from a REQ socket)")
            return
        reply = json.dumps(self._answer(frames[2])).encode()
        # A ROUTER socket drops (never blocks on) a reply to a peer that is gone or not reading.
        self._sock.send_multipart([frames[0], b"", reply], zmq.NOBLOCK)

    def _serve(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    ready = poller.poll(_POLL_MS)
                except zmq.ZMQError as e:  # e.g. EINTR: the socket itself cannot be at fault
                    self.background.record_error(THREAD_NAME, e, "a poll")
                    self._stop.wait(_POLL_MS / 1000)
                    continue
                if not ready:
                    continue
                try:
                    self._serve_one()
                except Exception as e:  # one message's failure is its own, never the service's end
                    self.background.record_error(THREAD_NAME, e, "a control message")
        finally:
            self._sock.close()

    def close(self) -> None:
        """Stops the serving thread (its end is not a failure), closes the socket."""
        if not self._stop.is_set():
            self.background.stopping(THREAD_NAME)
            self._stop.set()
            self._thread.join(timeout=5)
            self._ctx.term()


def _round_trip(zmq: Any, sock: Any, message: dict[str, Any], deadline: float, what: str) -> Any:
    sock.send(json.dumps(message).encode())
    if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
        raise KVTransferError(f"{what}: no answer in time")
    try:
        return loads_bounded(sock.recv(), max_bytes=MAX_REPLY_BYTES, max_depth=MAX_JSON_DEPTH, what="the answer")
    except InvalidArgumentError as e:
        raise KVTransferError(f"{what}: {e}") from None


def control_call(address: str, request: dict[str, Any], timeout: float, key: bytes) -> dict[str, Any]:
    """One authenticated request/reply with the producer at ``address`` (see the module docs);
    KVTransferError when it does not answer within ``timeout`` seconds, answers ``ok: false``
    or sends a reply that is not authenticated under ``key``. Whatever comes back, nothing but
    KVTransferError is raised (a reply is parsed within bounds and checked by type)."""
    zmq = import_zmq()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    what = f"KV control call {describe(request.get('op'))} to {str(address)[:300]}"
    deadline = time.monotonic() + timeout
    try:
        sock.connect(address)
        hello = _round_trip(zmq, sock, {"op": "hello"}, deadline, what)
        if not isinstance(hello, dict) or not _is(_NONCE, hello.get("nonce")):
            raise KVTransferError(f"{what}: no nonce in the answer to hello: {describe(hello)}")
        envelope = sign_request(key, hello["nonce"], request)
        answer = _round_trip(zmq, sock, envelope, deadline, what)
    except zmq.ZMQError as e:
        raise KVTransferError(f"{what} failed: {e}") from e
    finally:
        sock.close()
    body, mac = (answer.get("body"), answer.get("mac")) if isinstance(answer, dict) else (None, None)
    if not isinstance(body, str) or not _is(_MAC, mac):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise KVTransferError(f"{what}: refused without authentication: {_text(error)}")
    assert isinstance(mac, str)
    if not hmac.compare_digest(mac, _mac(key, b"rep", envelope["nonce"], envelope["cnonce"], body)):
        raise KVTransferError(f"{what}: the reply is not authenticated (another secret, or not a pagedkv producer)")
    try:
        reply = loads_bounded(body, max_bytes=MAX_REPLY_BYTES, max_depth=MAX_JSON_DEPTH, what="the reply")
    except InvalidArgumentError as e:
        raise KVTransferError(f"{what}: {e}") from None
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        error = reply.get("error") if isinstance(reply, dict) else reply
        raise KVTransferError(f"the KV producer at {address} refused {describe(request.get('op'))}: {_text(error)}")
    return reply
