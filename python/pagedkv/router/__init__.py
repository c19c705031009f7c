"""``pagedkv router``: one OpenAI-compatible front for several ``pagedkv serve`` engines.

Replica mode: the router follows every replica's KV-cache events (``pagedkv serve
--kv-events-endpoint``): it knows, per replica, which block hashes are cached, computes the
same hashes for a new prompt (``pagedkv._core.block_hashes``), and picks the replica whose
cache covers the longest run of the prompt's leading blocks, the least loaded one on a tie.

Disaggregated mode: each request is prefilled by a prefill engine (chosen the same way among
the prefill engines), then decoded by the least loaded decode engine, which pulls the prompt's
KV from the prefill engine. Modules:

* ``prefix_index``  which block hashes each replica holds, from its event batches
* ``subscriber``    a thread per replica: the ZMQ subscription, gaps filled from the replay socket
* ``forward``       one body to one engine, its answer (a stream byte for byte) to the client
* ``disagg``        the prefill request, its outcomes and fallbacks, then the decode
* ``app``           the FastAPI front: the two modes' state and routing, ``/metrics``
* ``launcher``      ``start_disagg``: a prefill engine, a decode engine and the router as processes
"""

from __future__ import annotations

from typing import Any

__all__ = ["DisaggDeployment", "Replica", "RouterArgs", "create_router_app", "start_disagg"]

_MODULES = {"DisaggDeployment": "launcher", "start_disagg": "launcher"}


def __getattr__(name: str) -> Any:
    # Imported on use: the app needs FastAPI and transformers, the launcher neither.
    if name in __all__:
        import importlib

        module = importlib.import_module(f"pagedkv.router.{_MODULES.get(name, 'app')}")
        return getattr(module, name)
    raise AttributeError(f"module 'pagedkv.router' has no attribute {name!r}")
