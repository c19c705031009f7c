"""``RouterArgs``: what ``pagedkv router`` is given (engines, policy, keys, limits), checked once.

The bottom of the router's modules: everything else (replicas, the routing state, forwarding,
the disaggregated flow, the app) reads it; it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

from pagedkv.errors import ConfigError
from pagedkv.server.limits import ServerLimits

__all__ = ["POLICIES", "RouterArgs"]

POLICIES = ("cache_aware", "round_robin")


@dataclass
class RouterArgs:
    """Either ``replicas`` or both ``prefill`` and ``decode``:

    - ``replicas``: base URLs of ``pagedkv serve`` replicas (``http://host:port``).
    - ``prefill``: base URLs of prefill engines (``pagedkv serve --kv-transfer-config
      '{"role": "producer", ...}'``): disaggregated mode.
    - ``decode``: base URLs of decode engines (``"role": "consumer"``).
    - ``model``: the engines' model, for its tokenizer (default: the embedded SmolLM2).
    - ``policy``: ``"cache_aware"`` or ``"round_robin"`` (over the replicas, or the prefill engines).
    - ``api_key``: the key the router's own clients must send (``Authorization: Bearer KEY``);
      None: the router is open to whoever reaches its socket.
    - ``engine_api_key``: the key the router sends to the engines (their ``--api-key``). A
      client's ``Authorization`` is never passed on: clients and engines have separate keys.
    - ``timeout``: seconds for an engine to answer (a stream: between chunks).
    - ``prefill_timeout``: seconds for a prefill engine to answer; past it the request is
      decoded without the prefill's KV (default: ``timeout``).
    - ``health_interval``: seconds between health checks of every engine (``GET /health``); an
      engine that fails one is routed around until it passes one again.
    - ``startup_timeout``: how long the router waits at start for a first engine to come up
      (engines still loading are waited for; the others join as they come up).
    - ``max_tokenize_bytes``: a body larger than this is routed by load without being
      tokenized (tokenizing is the router's only per-request CPU work; the engine still
      decides whether it accepts the prompt).
    - ``shutdown_timeout``: on SIGTERM, seconds the router lets streams run before it ends them
      with an error event and ``data: [DONE]``.
    - ``max_request_body_bytes``, ``header_timeout``, ``body_timeout``, ``max_connections``:
      the engines' connection guards (:class:`pagedkv.server.limits.ServerLimits`), at the
      router's own socket: a bigger body gets 413 before it is read (408 when it stalls, or is
      not whole ``body_timeout`` after its headers), a connection that does not send complete
      headers in time is closed, and so is one past the cap.
    - ``allow_client_kv_transfer_params``: pass a client's ``kv_transfer_params`` on to the
      engines (in disaggregated mode: straight to a decode engine, which pulls from the
      address they name). Off (the default): only the router and its prefill engines produce
      them, and a client body that carries them (not null) gets a 400 naming
      ``kv_transfer_params`` before anything is forwarded. Turn it on only for clients that
      are part of the deployment (another proxy that does its own prefills)."""

    replicas: list[str] = field(default_factory=list)
    model: str | None = None
    policy: str = "cache_aware"
    api_key: str | None = None
    timeout: float = 600.0
    trust_remote_code: bool = False
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    prefill_timeout: float | None = None
    engine_api_key: str | None = None
    health_interval: float = 2.0
    startup_timeout: float = 600.0
    max_tokenize_bytes: int = 1 << 20
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = ServerLimits.max_request_body_bytes
    header_timeout: float = ServerLimits.header_timeout
    body_timeout: float = ServerLimits.body_timeout
    max_connections: int = ServerLimits.max_connections
    allow_client_kv_transfer_params: bool = False

    def __post_init__(self) -> None:
        if self.replicas and (self.prefill or self.decode):
            raise ConfigError(
                "give either replicas or prefill and decode engines, not both "
                "(a router spreads requests over replicas, or splits each into a prefill and a decode)"
            )
        if self.disaggregated:
            if not self.prefill or not self.decode:
                raise ConfigError("the disaggregated router needs at least one prefill and at least one decode URL")
        elif not self.replicas:
            raise ConfigError("the router needs at least one replica URL (or prefill and decode URLs)")
        for url in [*self.replicas, *self.prefill, *self.decode]:
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigError(f"an engine is an http(s)://host:port URL, got {url!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in (
            "timeout",
            "prefill_timeout",
            "health_interval",
            "startup_timeout",
            "shutdown_timeout",
            "header_timeout",
            "body_timeout",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        for name in ("max_request_body_bytes", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.max_tokenize_bytes < 0:
            raise ConfigError(f"max_tokenize_bytes must be >= 0, got {self.max_tokenize_bytes!r}")
        for name in ("api_key", "engine_api_key"):
            if getattr(self, name) == "":
                raise ConfigError(f"{name} must not be empty (None: no key)")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode)

    def engine_headers(self) -> dict[str, str]:
        """The headers that authenticate the router to an engine (none without an engine key)."""
        return {"Authorization": f"Bearer {self.engine_api_key}"} if self.engine_api_key else {}
