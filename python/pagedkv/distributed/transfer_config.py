"""``kv_transfer_config`` (how an engine takes part in KV transfer) and ``kv_transfer_params``
(what one request asks of it), both validated here so bad values fail before anything moves.

Per request (vLLM's pull flow, the same key names):

- ``{"do_remote_decode": true}`` on a **producer**: run the prompt (a proxy sends
  ``max_tokens=1``) and, when the request ends, hold its KV blocks under a lease for a decode
  engine to read. The request's output carries the :class:`RemotePrefill` fields to forward.
- ``{"do_remote_prefill": true, "remote_engine_id": ..., ...}`` on a **consumer**: the prompt's
  KV is on that engine: reserve blocks, pull the ones not cached here, then decode.

The params come from a client, so they are a *claim*, never trusted for what they name: the
consumer pulls only after the producer, asked over the authenticated control plane with the
lease's unguessable ``remote_lease_token``, vouched for the blocks and the prompt tokens (see
``pagedkv.distributed.connector``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.bounded_json import describe
from pagedkv.config import config_from_any
from pagedkv.errors import ConfigError, InvalidArgumentError, PagedKVError

__all__ = [
    "SECRET_ENV",
    "KVTransferConfig",
    "RemotePrefill",
    "check_control_address",
    "parse_kv_transfer_params",
    "prompt_digest",
    "tokens_digest",
]

# Where an engine finds the deployment's shared secret when kv_transfer_config has no
# ``auth_secret`` (the environment is not shown by ``ps``, a command line is).
SECRET_ENV = "PAGEDKV_KV_TRANSFER_SECRET"
MIN_SECRET_BYTES = 16

ROLES = ("producer", "consumer", "both")
TRANSPORTS = ("nixl", "gloo", "auto")
FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """How an engine takes part in KV transfer (``EngineArgs.kv_transfer_config``; the CLI's
    ``--kv-transfer-config '{"role": "consumer"}'`` is this as JSON).

    - ``role``: ``"producer"`` (prefills and lends its KV), ``"consumer"`` (pulls KV, then
      decodes) or ``"both"``.
    - ``transport``: ``"nixl"``, ``"gloo"`` (torch.distributed; needs the ``gloo_*`` fields) or
      ``"auto"`` (NIXL when installed, else gloo).
    - ``engine_id``: this engine's name in ``kv_transfer_params`` (default: a random one).
    - ``control_host`` / ``control_port``: where a producer answers handshakes and lease
      releases (a ZMQ socket; port 0 picks a free one). Bind to loopback unless the peers are
      remote.
    - ``peers``: control addresses (``tcp://host:port``) of producers a consumer handshakes with
      at start; others are handshaken on first use, from the address in the request's params.
    - ``allowed_producers``: when not empty, the only control addresses a consumer pulls from:
      a request whose params name another is refused (InvalidArgumentError, a 400) before
      anything connects anywhere. Empty (the default): any ``tcp://host:port``. ``pagedkv
      serve --disagg`` (``pagedkv.router.launcher``) sets it to its prefill engine's address.
    - ``kv_load_failure_policy``: when a pull fails (dead peer, lease gone, transfer error),
      ``"recompute"`` the prompt here or ``"fail"`` the request with ``KVTransferError``.
    - ``lease_seconds``: how long a producer holds a finished request's blocks for a reader
      (> 0); expired leases are freed, and a read that finishes after its lease ended is
      treated as failed.
    - ``handshake_timeout``, ``transfer_timeout``: seconds (> 0) for a control call and for
      one pull; ``connect_timeout``: for a gloo group to form at start (both engines loading).
    - ``gloo_rank``, ``gloo_world_size``, ``gloo_init_method`` (``tcp://host:port``): this
      engine's place in the private gloo group (rank 0 hosts the store, bound to that host only).
    - ``auth_secret``: the secret every engine of the deployment shares (at least 16 bytes);
      every control message is authenticated with it (HMAC, per-call nonces), and gloo pull
      requests are signed with it. Default: the ``PAGEDKV_KV_TRANSFER_SECRET`` environment
      variable (preferred: a command line is visible in ``ps``). There is no unauthenticated
      mode: an engine with neither refuses to start (``ConfigError``). ``pagedkv serve
      --disagg`` generates one per deployment.
    """

    role: str = "both"
    transport: str = "auto"
    engine_id: str | None = None
    control_host: str = "127.0.0.1"
    control_port: int = 0
    peers: tuple[str, ...] = field(default_factory=tuple)
    allowed_producers: tuple[str, ...] = field(default_factory=tuple)
    kv_load_failure_policy: str = "recompute"
    lease_seconds: float = 30.0
    handshake_timeout: float = 10.0
    transfer_timeout: float = 30.0
    connect_timeout: float = 300.0
    gloo_rank: int | None = None
    gloo_world_size: int | None = None
    gloo_init_method: str | None = None
    auth_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"kv_transfer_config.role must be one of {ROLES}, got {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"kv_transfer_config.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ConfigError(
                f"kv_transfer_config.kv_load_failure_policy must be one of {FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        for name in ("lease_seconds", "handshake_timeout", "transfer_timeout", "connect_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"kv_transfer_config.{name} must be a number > 0, got {value!r}")
        if isinstance(self.control_port, bool) or not isinstance(self.control_port, int):
            raise ConfigError(f"kv_transfer_config.control_port must be an int, got {self.control_port!r}")
        if not 0 <= self.control_port < 65536:
            raise ConfigError(f"kv_transfer_config.control_port must be in 0..65535, got {self.control_port}")
        for name in ("peers", "allowed_producers"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ConfigError(f"kv_transfer_config.{name} must be a list of tcp://host:port, got {value!r}")
            for address in value:
                check_control_address(address, f"kv_transfer_config.{name}", ConfigError)
            object.__setattr__(self, name, tuple(value))
        if self.engine_id is not None and (not isinstance(self.engine_id, str) or not self.engine_id):
            raise ConfigError(f"kv_transfer_config.engine_id must be a non-empty str, got {self.engine_id!r}")
        if self.auth_secret is not None:
            _check_secret(self.auth_secret, "kv_transfer_config.auth_secret")

    def secret(self) -> bytes:
        """The deployment's shared secret: ``auth_secret``, else ``$PAGEDKV_KV_TRANSFER_SECRET``.
        ConfigError when neither is set (checked when the engine's connector starts, not when
        the config is parsed, so a launcher can validate configs that get their secret from
        the environment of the process it starts)."""
        if self.auth_secret is not None:
            return self.auth_secret.encode()
        value = os.environ.get(SECRET_ENV)
        if value is None:
            raise ConfigError(
                "KV transfer needs a secret shared by the engines of the deployment: set "
                f"${SECRET_ENV} (or kv_transfer_config.auth_secret) to the same random string of "
                f"at least {MIN_SECRET_BYTES} bytes on every engine, e.g. from "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        _check_secret(value, f"${SECRET_ENV}")
        return value.encode()

    @property
    def is_producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("consumer", "both")

    @classmethod
    def from_any(cls, value: KVTransferConfig | Mapping[str, Any] | str) -> KVTransferConfig:
        """A config from itself, a dict, or its JSON text (the CLI flag)."""
        return config_from_any(cls, value, "kv_transfer_config")


def _check_secret(value: object, name: str) -> None:
    if not isinstance(value, str) or len(value.encode()) < MIN_SECRET_BYTES:
        raise ConfigError(f"{name} must be a str of at least {MIN_SECRET_BYTES} bytes")


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A key for one use of the shared secret (the control plane, gloo pull requests), so that
    a MAC made for one can never pass as the other's."""
    return hmac.new(secret, f"pagedkv kv-transfer {purpose} v1".encode(), hashlib.sha256).digest()


def tokens_digest(token_ids: Sequence[int]) -> str:
    """sha256 of token ids (int64 bytes): what a producer vouches for when a consumer claims a
    lease (in an authenticated reply), and what the consumer compares with its own prompt."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A short digest of prompt token ids, carried in the params: a consumer refuses at once
    params of another prompt (a proxy that rewrote the prompt). Anyone can compute it, so it
    protects nothing against a hostile client: the producer's vouched ``tokens_digest`` does."""
    return tokens_digest(token_ids)[:32]


@dataclass(frozen=True)
class RemotePrefill:
    """Where a prompt's KV is: the producer's answer, forwarded by the proxy to a consumer.

    ``remote_block_ids`` hold the KV of the first ``remote_num_tokens`` prompt tokens (the
    leading ``remote_num_tokens // remote_block_size`` blocks are full); the producer holds
    them under the lease of ``remote_request_id`` at control address ``remote_address``.
    ``remote_lease_token`` (pagedkv's key; the rest are vLLM's) is the lease's unguessable
    capability: whoever presents it first (a consumer engine) may claim the lease. The ids,
    counts and digest are informative only; the consumer uses what the producer vouches for.
    """

    remote_engine_id: str
    remote_address: str
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    remote_num_tokens: int
    remote_block_size: int
    remote_kv_dtype: str
    prompt_digest: str
    remote_lease_token: str = field(repr=False)

    def to_params(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["remote_block_ids"] = list(self.remote_block_ids)
        return {"do_remote_prefill": True, "do_remote_decode": False, **d}


_PREFILL_KEYS = {f.name for f in dataclasses.fields(RemotePrefill)}
_FLAG_KEYS = {"do_remote_prefill", "do_remote_decode"}

# Bounds of kv_transfer_params (docs/limits.md): everything a consumer's pull thread is handed
# has passed them, so no value it meets can be of a type, size or shape it does not expect.
MAX_PARAM_CHARS = 256  # remote_engine_id, remote_request_id, remote_kv_dtype, remote_address
MAX_REMOTE_BLOCK_IDS = 1 << 20  # every KV cache group's block ids together
MAX_BLOCK_ID = (1 << 31) - 1  # block ids and token counts are int32 in the core and on the wire
MAX_BLOCK_SIZE = 1 << 16
_LEASE_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")  # secrets.token_urlsafe's alphabet
_DIGEST = re.compile(r"[0-9a-f]{32}")  # prompt_digest's form
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_control_address(address: object, name: str, error: type[PagedKVError] = InvalidArgumentError) -> str:
    """``address`` if it is a KV control address, ``tcp://HOST:PORT`` (HOST an IPv4 address,
    ``[IPv6]`` or a DNS name; PORT 1..65535; at most 256 characters), else ``error`` naming
    ``name``. Wildcards (``*``), other transports (``ipc://``, ``inproc://``) and anything a ZMQ
    ``connect`` would read differently are refused."""
    shown = describe(address)
    if not isinstance(address, str) or not address.isascii() or len(address) > MAX_PARAM_CHARS:
        raise error(f"{name} must be tcp://host:port (ASCII, at most {MAX_PARAM_CHARS} characters), got {shown}")
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    ok = address.startswith("tcp://") and sep and port.isdigit() and port[0] != "0" and int(port) <= 65535
    if ok and host.startswith("[") and host.endswith("]"):
        try:
            ok = isinstance(ipaddress.ip_address(host[1:-1]), ipaddress.IPv6Address)
        except ValueError:
            ok = False
    elif ok:
        labels = host.split(".")
        ok = len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)
    if not ok:
        raise error(f"{name} must be tcp://host:port (a host name or IP address, port 1..65535), got {shown}")
    return address


def parse_kv_transfer_params(params: Any) -> bool | RemotePrefill | None:
    """``None`` (no transfer), ``True`` (``do_remote_decode``: hold the KV for a reader) or the
    :class:`RemotePrefill` to pull. Anything else — unknown keys, both flags, wrong types,
    nested values, strings or lists past their bounds (``MAX_PARAM_CHARS``,
    ``MAX_REMOTE_BLOCK_IDS``), ids outside int32, an address that is not ``tcp://host:port`` —
    raises InvalidArgumentError naming ``kv_transfer_params`` and the field; nothing else is
    raised, whatever ``params`` is. A value returned holds only what the types say."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    if not all(isinstance(k, str) for k in params):
        raise InvalidArgumentError("kv_transfer_params keys must be str")
    unknown = sorted(set(params) - _PREFILL_KEYS - _FLAG_KEYS)
    if unknown:
        shown = [describe(k) for k in unknown[:5]]
        raise InvalidArgumentError(f"unknown kv_transfer_params key(s) {', '.join(shown)}")
    for flag in _FLAG_KEYS:
        if flag in params and not isinstance(params[flag], bool):
            raise InvalidArgumentError(f"kv_transfer_params.{flag} must be a bool, got {describe(params[flag])}")
    decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if decode and prefill:
        raise InvalidArgumentError("kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill")
    if decode:
        extra = sorted(set(params) & _PREFILL_KEYS)
        if extra:
            raise InvalidArgumentError(f"kv_transfer_params with do_remote_decode takes no {extra}")
        return True
    if not prefill:
        if set(params) & _PREFILL_KEYS:
            raise InvalidArgumentError("kv_transfer_params name a remote prefill but do_remote_prefill is not true")
        return None
    missing = sorted(_PREFILL_KEYS - set(params))
    if missing:
        raise InvalidArgumentError(f"kv_transfer_params with do_remote_prefill lack {missing}")

    def text(name: str, pattern: re.Pattern[str] | None = None) -> str:
        value = params[name]
        ok = isinstance(value, str) and 0 < len(value) <= MAX_PARAM_CHARS and value.isprintable()
        if ok and pattern is not None:
            ok = pattern.fullmatch(value) is not None
        if not ok:
            form = "a non-empty printable str" if pattern is None else f"a str matching {pattern.pattern}"
            raise InvalidArgumentError(
                f"kv_transfer_params.{name} must be {form} of at most {MAX_PARAM_CHARS} characters, "
                f"got {describe(value)}"
            )
        return str(value)

    def count(name: str, minimum: int, maximum: int) -> int:
        value = params[name]
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise InvalidArgumentError(
                f"kv_transfer_params.{name} must be an int in [{minimum}, {maximum}], got {describe(value)}"
            )
        return value

    ids = params["remote_block_ids"]
    if not isinstance(ids, (list, tuple)) or len(ids) > MAX_REMOTE_BLOCK_IDS:
        raise InvalidArgumentError(
            f"kv_transfer_params.remote_block_ids must be a list of at most {MAX_REMOTE_BLOCK_IDS} ints, "
            f"got {describe(ids)}"
        )
    if any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BLOCK_ID for b in ids):
        raise InvalidArgumentError(f"kv_transfer_params.remote_block_ids must be ints in [0, {MAX_BLOCK_ID}]")
    remote = RemotePrefill(
        remote_engine_id=text("remote_engine_id"),
        remote_address=check_control_address(params["remote_address"], "kv_transfer_params.remote_address"),
        remote_request_id=text("remote_request_id"),
        remote_block_ids=tuple(ids),
        remote_num_tokens=count("remote_num_tokens", 0, MAX_BLOCK_ID),
        remote_block_size=count("remote_block_size", 1, MAX_BLOCK_SIZE),
        remote_kv_dtype=text("remote_kv_dtype"),
        prompt_digest=text("prompt_digest", _DIGEST),
        remote_lease_token=text("remote_lease_token", _LEASE_TOKEN),
    )
    needed = -(-remote.remote_num_tokens // remote.remote_block_size)
    if len(remote.remote_block_ids) < needed:
        raise InvalidArgumentError(
            f"kv_transfer_params: {len(remote.remote_block_ids)} block ids cannot hold "
            f"{remote.remote_num_tokens} tokens of {remote.remote_block_size}-token blocks"
        )
    return remote
