"""``pagedkv router``: one OpenAI-compatible front for several ``pagedkv serve`` replicas that
sends each request to the replica holding the longest cached prefix of its prompt.

The router follows every replica's KV-cache events (``pagedkv serve --kv-events-endpoint``):
it knows, per replica, which block hashes are cached, computes the same hashes for a new
prompt (``pagedkv._core.block_hashes``), and picks the replica whose cache covers the longest run
of the prompt's leading blocks, the least loaded one on a tie. Modules:

* ``prefix_index``  which block hashes each replica holds, from its event batches
* ``subscriber``    a thread per replica: the ZMQ subscription, gaps filled from the replay socket
* ``app``           the FastAPI front: routing, streaming passthrough, ``/metrics``
"""

from __future__ import annotations

from typing import Any

__all__ = ["Replica", "RouterArgs", "create_router_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from pagedkv.router import app

        return getattr(app, name)
    raise AttributeError(f"module 'pagedkv.router' has no attribute {name!r}")
