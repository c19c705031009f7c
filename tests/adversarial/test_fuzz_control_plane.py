"""A time-boxed fuzzer (hypothesis) of what unauthenticated peers and clients hand the servers:
the KV transfer control plane's framing, and the request models and parameter parsers.

* **The control server** (``pagedkv.distributed.control.ControlServer``, the real one, over
  ZMQ on loopback): random frames, frame counts, garbled and deeply nested JSON, envelopes with
  fields of every type (non-ASCII MACs, lone surrogates, numbers for nonces), oversized frames,
  and requests correctly signed around random bodies. After each example the server must still
  answer a correctly signed request, every answer it gave must be a JSON object that refuses
  (or a nonce), and at the end its thread is alive with the refusals counted.
* **A consumer's calls** (``control_call``) against a rogue producer that answers random
  replies: nothing but ``KVTransferError`` comes out (the pull thread's handshake, claim and
  release go through it).
* **The request models** (``server/protocol.py``: completions, chat, tokenize, detokenize) and
  ``parse_kv_transfer_params``, ``check_control_address``, ``loads_bounded``: random JSON-ish
  input gives a value or a typed error (pydantic's ``ValidationError``, ``ConstraintError``, a
  ``PagedKVError``), never another exception.

Time box: under ``make test`` each property runs a fixed number of examples (a few seconds in
all; ``--hypothesis-seed`` makes them the same every run). On demand, ``PAGEDKV_FUZZ_SECONDS=N``
runs each property in batches of fresh examples for about ``N`` seconds:

    PAGEDKV_FUZZ_SECONDS=300 .venv/bin/python -m pytest -q tests/adversarial/test_fuzz_control_plane.py
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import zmtp_claim_frame
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagedkv.bounded_json import describe, json_depth, loads_bounded
from pagedkv.distributed.control import (
    MAX_JSON_DEPTH,
    MAX_REQUEST_BYTES,
    THREAD_NAME,
    ControlServer,
    _mac,
    control_call,
    import_zmq,
)
from pagedkv.distributed.transfer_config import check_control_address, parse_kv_transfer_params
from pagedkv.errors import InvalidArgumentError, KVTransferError, PagedKVError

zmq = import_zmq()

FUZZ_SECONDS = float(os.environ.get("PAGEDKV_FUZZ_SECONDS", "0") or 0)
KEY = b"fuzz-control-key-0123456789abcdef"
TIMEOUT = 5.0


def fuzz(test: Callable[..., None], examples: int) -> None:
    """Runs ``test`` (a ``@given`` function): ``examples`` examples (``make test``: the seed is
    pytest's ``--hypothesis-seed``), or, with ``PAGEDKV_FUZZ_SECONDS``, batches under fresh
    seeds until that many seconds have passed."""
    config = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    configured = config(test)
    if FUZZ_SECONDS <= 0:
        configured()
        return
    end = time.monotonic() + FUZZ_SECONDS
    batch = random.SystemRandom().randrange(1 << 30)
    while time.monotonic() < end:
        seed(batch)(configured)()  # a fresh seed per batch: new examples
        batch += 1


# ----------------------------------------------------------------------------- strategies


def nested(depth: int, leaf: Any = 0) -> Any:
    """``leaf`` in ``depth`` lists (built without recursion)."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# Non-ASCII, lone surrogates (a JSON "\ud800" escape), control characters, a MAC's length.
ODD_TEXT = st.text(max_size=70) | st.sampled_from(["\ud800", "\udfff", "\x00", "é" * 64, "０" * 32])
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | ODD_TEXT
JSONISH = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=16,
)
# Python values past any sane depth, and past the JSON parser's own recursion limit (handed to
# the models and parsers directly: json.dumps could not even write them).
DEEP = st.integers(min_value=1, max_value=3000).map(nested)
ANY_VALUE = JSONISH | DEEP
HEXISH = st.text(alphabet="0123456789abcdefABCDEF", max_size=70)


def deep_json_text(depth: int, opener: str = "[") -> bytes:
    """JSON text nested ``depth`` deep (lists or objects), written without recursion."""
    if opener == "{":
        return ('{"a":' * depth + "0" + "}" * depth).encode()
    return ("[" * depth + "]" * depth).encode()


ENVELOPE_FIELD = HEXISH | SCALARS | st.integers(1, 200).map(nested)
ENVELOPES = st.fixed_dictionaries(
    {},
    optional={
        "op": st.sampled_from(["hello", "metadata", "claim"]) | ENVELOPE_FIELD,
        "nonce": ENVELOPE_FIELD,
        "cnonce": ENVELOPE_FIELD,
        "body": ENVELOPE_FIELD | JSONISH.map(json.dumps),
        "mac": ENVELOPE_FIELD,
    },
)


def dumps_any(value: Any, ensure_ascii: bool = True) -> bytes:
    """``value`` as JSON bytes, lone surrogates kept (invalid UTF-8 when not escaped)."""
    return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


def _payload(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "envelope", "deep", "surrogate"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return dumps_any(draw(JSONISH), draw(st.booleans()))
    if kind == "envelope":
        return dumps_any(draw(ENVELOPES), draw(st.booleans()))
    if kind == "deep":
        # Nested past the parser's recursion limit, yet within MAX_REQUEST_BYTES (2 or 6 bytes a level).
        opener = draw(st.sampled_from("[{"))
        return deep_json_text(draw(st.integers(1, 30000 if opener == "[" else 10000)), opener)
    assert kind == "surrogate"
    return b'{"nonce": "\\ud800", "cnonce": "\\udfff", "body": "\\ud800", "mac": "\\u00e9"}'


@st.composite
def messages(draw: st.DrawFn) -> list[bytes] | int:
    """The frames a DEALER sends (the ROUTER adds the identity): usually REQ's ``[b"",
    payload]``, sometimes more, fewer or other frames; or (an int) the size an oversized frame
    claims (sent by hand: :func:`harness.zmtp_claim_frame`)."""
    shape = draw(st.sampled_from(["req", "req", "req", "no-delimiter", "extra", "many", "oversized"]))
    if shape == "oversized":
        return draw(st.integers(MAX_REQUEST_BYTES + 1, 1 << 40))
    payload = _payload(draw)
    if shape == "req":
        return [b"", payload]
    if shape == "no-delimiter":
        return [payload]
    if shape == "extra":
        return [b"", payload, draw(st.binary(max_size=20))]
    return [b""] * draw(st.integers(2, 200)) + [payload]


# ----------------------------------------------------------------------------- the control server


@pytest.fixture(scope="module")
def server() -> Iterator[ControlServer]:
    handlers = {
        "metadata": lambda r: {"ok": True, "metadata": "{}", "fingerprint": {"layout": {"columns": 1}}},
        "echo": lambda r: {"ok": True, "request": r},
        "boom": lambda r: {"ok": True, "x": [1 / 0]},  # a handler that raises: the request's answer
    }
    control = ControlServer("127.0.0.1", 0, handlers, KEY)
    yield control
    control.close()


def _dealer(address: str) -> Any:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _answers_of(sock: Any) -> list[dict[str, Any]]:
    """Sends a hello after what was sent on ``sock`` and returns the answers before the first
    nonce (a ROUTER answers one peer's messages in order, so the hello's nonce comes after the
    answer to what was sent, if it got one): each must be a JSON object."""
    sock.send_multipart([b"", b'{"op": "hello"}'])
    answers = []
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "the control server stopped answering"
        frames = sock.recv_multipart()
        assert len(frames) == 2 and frames[0] == b"", frames
        answer = json.loads(frames[1])
        assert isinstance(answer, dict), answer
        if answer.get("ok") is True and "nonce" in answer:
            return answers
        answers.append(answer)


def test_the_control_server_survives_any_frames(server: ControlServer) -> None:
    before = server.background.error_counts().get(THREAD_NAME, 0)

    @given(messages())
    def one(frames: list[bytes] | int) -> None:
        if isinstance(frames, int):  # a frame past the bound: its sender is cut off at its header
            assert zmtp_claim_frame(server.address, frames), "the oversized sender was not disconnected"
        else:
            # Within the bound, so the server reads it whole and answers the hello after it.
            assert all(len(f) <= MAX_REQUEST_BYTES for f in frames)
            sock = _dealer(server.address)
            try:
                sock.send_multipart(frames)
                for answer in _answers_of(sock):  # refusals, never a signed answer
                    assert answer.get("ok") is False and "body" not in answer and "mac" not in answer, answer
            finally:
                sock.close()
        reply = control_call(server.address, {"op": "metadata"}, TIMEOUT, KEY)
        assert reply["metadata"] == "{}"

    fuzz(one, examples=120)
    health = server.background.health()
    assert health["status"] == "ok" and health["threads"][THREAD_NAME]["alive"], health
    assert server.background.error_counts()[THREAD_NAME] > before, "the refusals are counted"


def test_signed_requests_with_any_body_get_an_answer(server: ControlServer) -> None:
    # The secret's holders are trusted, but a body they sign is still parsed within bounds.
    ops = st.sampled_from(["metadata", "echo", "boom", "claim"]) | SCALARS
    bodies = (
        JSONISH.map(json.dumps)
        | st.fixed_dictionaries({"op": ops}, optional={"x": JSONISH}).map(json.dumps)
        | st.integers(1, 30000).map(lambda n: deep_json_text(n).decode())
        | st.sampled_from(['{"op": "echo", "x": ' + "[" * 20 + "]" * 20 + "}", "{", '"x"', '{"op": "\ud800"}'])
    )

    @given(bodies)
    def one(body: str) -> None:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        try:
            sock.send(b'{"op": "hello"}')
            assert sock.poll(int(TIMEOUT * 1000))
            nonce, cnonce = json.loads(sock.recv())["nonce"], "c" * 32
            mac = _mac(KEY, b"req", nonce, cnonce, body)
            sock.send(dumps_any({"nonce": nonce, "cnonce": cnonce, "body": body, "mac": mac}))
            assert sock.poll(int(TIMEOUT * 1000)), "no answer to a signed request"
            answer = json.loads(sock.recv())
        finally:
            sock.close()
        assert isinstance(answer, dict)
        if "body" in answer:  # answered after authentication: a JSON object, ok or not
            assert isinstance(json.loads(answer["body"]), dict)
        else:
            assert answer["ok"] is False

    fuzz(one, examples=60)
    assert server.background.health()["threads"][THREAD_NAME]["alive"]


# ----------------------------------------------------------------------------- a rogue producer


class Rogue:
    """A ROUTER that answers each request with the next of ``script`` (bytes), on a thread."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.script: list[bytes] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart()
            with self.lock:
                reply = self.script.pop(0) if self.script else b"{}"
            self.sock.send_multipart([frames[0], b"", reply])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)
        self.sock.close()


REPLIES = (
    st.binary(max_size=200)
    | JSONISH.map(dumps_any)
    | ENVELOPES.map(lambda v: dumps_any(v, ensure_ascii=False))
    | st.integers(1, 30000).map(deep_json_text)
    | st.fixed_dictionaries({"ok": st.just(True), "nonce": ENVELOPE_FIELD}).map(dumps_any)
)
HELLO_REPLIES = REPLIES | st.just(json.dumps({"ok": True, "nonce": "0" * 32}).encode())


def test_a_consumers_call_raises_only_kv_transfer_errors_whatever_a_producer_answers() -> None:
    rogue = Rogue()
    try:

        @given(HELLO_REPLIES, REPLIES)
        def one(hello: bytes, answer: bytes) -> None:
            with rogue.lock:
                rogue.script[:] = [hello, answer]
            with pytest.raises(KVTransferError):
                control_call(rogue.address, {"op": "claim", "token": "t"}, TIMEOUT, KEY)

        fuzz(one, examples=120)
    finally:
        rogue.close()


# ----------------------------------------------------------------------------- models and parsers


def _models() -> dict[str, Any]:
    pytest.importorskip("fastapi")
    from pagedkv.server import protocol

    return {
        name: getattr(protocol, name)
        for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest")
    }


def test_request_models_give_a_value_or_a_typed_error() -> None:
    from pagedkv.server.protocol import ConstraintError

    models = _models()
    names = sorted({field for model in models.values() for field in model.model_fields})
    field_values = ANY_VALUE | st.lists(
        st.dictionaries(st.sampled_from(["role", "content", "type", "text"]), ANY_VALUE)
    )
    bodies = st.dictionaries(st.sampled_from(names) | st.text(max_size=8), field_values, max_size=8)

    @given(st.sampled_from(sorted(models)), bodies | ANY_VALUE)
    def one(name: str, body: Any) -> None:
        model = models[name]
        try:
            request = model.model_validate(body)
        except ValidationError as exc:
            assert exc.errors(), exc  # what the server's handler reads for its 400
            return
        for method in ("unsupported", "constraint"):
            if hasattr(request, method):
                try:
                    getattr(request, method)()
                except (ConstraintError, PagedKVError):
                    pass
        if hasattr(request, "logit_bias_ids"):
            try:
                request.logit_bias_ids()
            except ValueError:  # documented: a key that is not a token id
                pass

    fuzz(one, examples=400)


PARAM_KEYS = [
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_address",
    "remote_request_id",
    "remote_block_ids",
    "remote_num_tokens",
    "remote_block_size",
    "remote_kv_dtype",
    "prompt_digest",
    "remote_lease_token",
]
GOOD_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "p0",
    "remote_address": "tcp://127.0.0.1:5555",
    "remote_request_id": "cmpl-1",
    "remote_block_ids": [1, 2],
    "remote_num_tokens": 20,
    "remote_block_size": 16,
    "remote_kv_dtype": "float32",
    "prompt_digest": "0" * 32,
    "remote_lease_token": "A" * 43,
}


def test_kv_transfer_params_give_a_value_or_an_invalid_argument_error() -> None:
    values = (
        ANY_VALUE
        | st.lists(st.integers(), max_size=5)
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.from_regex(r"tcp://[a-z0-9.\[\]:*-]{0,20}:[0-9]{0,6}", fullmatch=True)
    )
    mutated = st.builds(
        lambda changes, dropped: {k: v for k, v in {**GOOD_PARAMS, **changes}.items() if k not in dropped},
        st.dictionaries(st.sampled_from(PARAM_KEYS) | st.text(max_size=6), values, max_size=3),
        st.sets(st.sampled_from(PARAM_KEYS), max_size=2),
    )

    @given(mutated | st.dictionaries(st.sampled_from(PARAM_KEYS), values) | ANY_VALUE)
    def one(params: Any) -> None:
        try:
            parsed = parse_kv_transfer_params(params)
        except InvalidArgumentError as exc:
            assert str(exc).startswith(("kv_transfer_params", "unknown kv_transfer_params")), exc
            assert len(str(exc)) < 1000, "a bounded message"
            return
        assert parsed is None or parsed is True or all(0 <= b < 2**31 for b in parsed.remote_block_ids)

    fuzz(one, examples=400)
    assert parse_kv_transfer_params(GOOD_PARAMS) is not None


def test_control_addresses_and_bounded_json_refuse_with_one_error() -> None:
    @given(st.text(max_size=80) | st.from_regex(r"tcp://[^:]{0,30}:[0-9]{1,6}", fullmatch=True) | SCALARS)
    def address(value: Any) -> None:
        try:
            check_control_address(value, "x")
        except InvalidArgumentError:
            return
        assert isinstance(value, str) and value.startswith("tcp://") and "*" not in value

    @given(st.binary(max_size=200) | st.integers(1, 30000).map(deep_json_text) | ODD_TEXT)
    def loads(data: bytes | str) -> None:
        try:
            value = loads_bounded(data, max_bytes=MAX_REQUEST_BYTES, max_depth=MAX_JSON_DEPTH)
        except InvalidArgumentError:
            return
        assert json_depth(value) <= MAX_JSON_DEPTH
        describe(value)

    fuzz(address, examples=200)
    fuzz(loads, examples=200)
