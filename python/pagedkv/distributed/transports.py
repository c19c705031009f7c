"""Building a KV transport by name: the one module that knows every transport.

It sits above ``kv_transport`` (the interface and shared helpers) and the transports that
implement it, so that none of those imports another's importer (no import circle).
"""

from __future__ import annotations

from typing import Literal

from pagedkv.distributed.kv_transport import KVTransport, nixl_available
from pagedkv.errors import ConfigError

__all__ = ["make_transport"]


def make_transport(
    kind: Literal["nixl", "gloo", "auto"] = "auto",
    *,
    engine_id: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout: float = 30.0,
    auth_key: bytes | None = None,
    loopback_only: bool = False,
) -> KVTransport:
    """``nixl``: NixlTransport(engine_id, loopback_only). ``gloo``: GlooTransport(rank, world_size, init_method,
    timeout, auth_key), the first three required. ``auto``: NIXL when importable, else gloo.
    Both ends of a pair must pick the same kind (``add_peer`` refuses a mismatch).
    ``auth_key``: gloo pull requests are signed with it and the holder refuses unsigned ones
    (the connector passes a key derived from the deployment's secret)."""
    if kind == "auto":
        kind = "nixl" if nixl_available() else "gloo"
    # The transport modules are imported only when chosen: NIXL is an optional extra.
    if kind == "nixl":
        from pagedkv.distributed.nixl_transport import NixlTransport

        return NixlTransport(engine_id=engine_id, loopback_only=loopback_only)
    if kind == "gloo":
        if rank is None or world_size is None or init_method is None:
            raise ConfigError("the gloo KV transport needs rank, world_size and init_method (tcp://host:port)")
        from pagedkv.distributed.gloo_transport import GlooTransport

        return GlooTransport(
            rank=rank, world_size=world_size, init_method=init_method, timeout=timeout, auth_key=auth_key
        )
    raise ConfigError(f"unknown KV transport {kind!r} (expected 'nixl', 'gloo' or 'auto')")
