"""The control plane of KV transfer: a producer's small ZMQ request/reply service.

A producer binds a ROUTER socket at ``kv_transfer_config.control_host:control_port`` and
answers, from one daemon thread, JSON requests:

- ``{"op": "metadata"}`` → ``{"ok": true, "metadata": <transport metadata, text>,
  "fingerprint": {...}}``: the handshake. The consumer hands ``metadata`` to its transport's
  ``add_peer`` (which refuses another layout) and compares ``fingerprint`` (model and KV
  format) with its own.
- ``{"op": "release", "request_id": ...}`` → ``{"ok": true, "held": bool}``: ends a lease.
  ``held`` says whether the lease was still held, i.e. whether the blocks stayed untouched
  until now; a reader that gets ``false`` must not trust what it read.

Bad requests get ``{"ok": false, "error": ...}``; the service never dies of one. The data itself
never goes through here (that is the transport's job).

A consumer calls with :func:`control_call`: one REQ socket per call (a REQ socket is unusable
after a timeout), loopback round trip well under a millisecond, linger 0 so a dead peer never
blocks shutdown.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from pagedkv.errors import ConfigError, KVTransferError

__all__ = ["ControlServer", "control_call", "import_zmq"]

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the serving thread looks at its stop flag


def import_zmq() -> Any:
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - the serve extra brings it
        raise ConfigError("KV transfer needs pyzmq: pip install 'pagedkv[serve]'") from e
    return zmq


class ControlServer:
    """Answers control requests with ``handlers[op](request) -> reply dict`` on a daemon thread.
    ``address`` is the bound ``tcp://host:port`` (port 0 picks a free one)."""

    def __init__(self, host: str, port: int, handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagedkv-kv-control", daemon=True)
        self._thread.start()

    def _answer(self, payload: bytes) -> dict[str, Any]:
        try:
            request = json.loads(payload)
        except ValueError:
            return {"ok": False, "error": "the request is not JSON"}
        if not isinstance(request, dict) or request.get("op") not in self._handlers:
            return {"ok": False, "error": f"unknown op; known: {sorted(self._handlers)}"}
        try:
            return self._handlers[request["op"]](request)
        except Exception as e:  # a handler's failure is this request's answer, not the service's end
            logger.warning("KV control request %r failed", request.get("op"), exc_info=True)
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

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


def control_call(address: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One request/reply with the producer at ``address``; KVTransferError when it does not
    answer within ``timeout`` seconds or answers ``ok: false``."""
    zmq = import_zmq()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(json.dumps(request).encode())
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise KVTransferError(
                f"the KV producer at {address} did not answer {request.get('op')!r} in {timeout:.1f}s"
            )
        reply = json.loads(sock.recv())
    except zmq.ZMQError as e:
        raise KVTransferError(f"KV control call to {address} failed: {e}") from e
    finally:
        sock.close()
    if not isinstance(reply, dict) or not reply.get("ok"):
        error = reply.get("error") if isinstance(reply, dict) else reply
        raise KVTransferError(f"the KV producer at {address} refused {request.get('op')!r}: {error}")
    return reply
