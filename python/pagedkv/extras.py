"""Which optional extra provides which import, and the typed error for a missing one.

``pip install pagedkv`` is the Rust core and numpy alone; the model engine (``LLM``,
``LLMEngine``, ``pagedkv generate``), the server and the rest are extras. Code that reaches for
one inside :func:`needs_extra` turns the bare ``ModuleNotFoundError: No module named 'torch'``
into a :class:`~pagedkv.errors.MissingDependencyError` (an ``ImportError``) that names the
command to run. A missing module that no extra provides is re-raised as it is (a real bug).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pagedkv.errors import MissingDependencyError

__all__ = ["EXTRA_OF", "needs_extra"]

# Top-level import name -> the extra (pyproject.toml's optional-dependencies) that installs it.
EXTRA_OF = {
    "torch": "engine",
    "transformers": "engine",
    "tokenizers": "engine",
    "safetensors": "engine",
    "tqdm": "engine",
    "gguf": "engine",
    "accelerate": "engine",
    "matplotlib": "sim",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "zmq": "serve",
    "msgspec": "serve",
    "ray": "ray",
    "nixl": "nixl",
}


@contextmanager
def needs_extra(what: str) -> Iterator[None]:
    """Runs the body; a ``ModuleNotFoundError`` for a module an extra provides becomes a
    MissingDependencyError: "``what`` needs torch, which is not installed: pip install
    'pagedkv[engine]'"."""
    try:
        yield
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        extra = EXTRA_OF.get(top)
        if extra is None:
            raise
        raise MissingDependencyError(
            f"{what} needs {top}, which is not installed: pip install 'pagedkv[{extra}]'"
        ) from exc
