"""``pagedkv serve``: an OpenAI-compatible HTTP server over :class:`pagedkv.AsyncLLM`.

Needs the ``serve`` extra (``pip install "pagedkv[serve]"``: FastAPI, uvicorn,
prometheus_client, pyzmq, msgspec). ``create_app`` is the ASGI app factory
(``uvicorn --factory pagedkv.server:create_app``). Modules, one job each:

* ``app``          the FastAPI app: routes, auth, error handlers (``create_app``, ``ServerArgs``)
* ``protocol``     OpenAI's request and response schemas (pydantic)
* ``serving``      admission, the queue limit, running engine requests, disconnects
* ``completions``  ``/v1/completions``; ``chat``: ``/v1/chat/completions``
* ``errors``       OpenAI error bodies and the status of each pagedkv error
* ``metrics``      Prometheus metrics with vLLM's names
* ``kv_events``    KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared) over ZMQ, with replay
* ``run``          uvicorn with graceful shutdown (what the CLI runs)
* ``limits``       ``ServerLimits`` (body size, prompt characters, prompts per request, header
  timeout, connections, request chat templates) and their flags
* ``body_limit``   the body size limit, enforced while the body is read
* ``connections``  uvicorn's protocol with a header timeout and a connection cap (slowloris)
* ``chat_template`` a request's own chat template in a bounded Jinja sandbox
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerArgs", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy: importing pagedkv.server.kv_events alone does not load FastAPI.
    if name in __all__:
        from pagedkv.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'pagedkv.server' has no attribute {name!r}")
