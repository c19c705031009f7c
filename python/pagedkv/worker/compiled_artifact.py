"""The compiled forward on disk, so that a restart skips the compiler.

A process that compiles the forward (``enforce_eager=False``) saves it whole with torch's
ahead-of-time capture (``torch.compile(...).aot_compile``, then ``save_compiled_function``):
dynamo's output bytecode and the inductor code it calls, a file of a few MB. A later process
with the same key loads it (``torch.compiler.load_compiled_function``) and runs it without
tracing anything: SmolLM2's warm start went from 10-21 s more than an eager start (dynamo
traced the model again; inductor's and AOT autograd's disk caches only skip the compile after
the trace) to under 1 s more (benches/RESULTS.md, "Compiled forward: compile time at start").

**What the key covers.** A loaded forward checks no guard (the capture drops them all: an
artifact guarded on object ids could not load in another process), so everything the trace
depended on is in the file's name, a SHA-256 of (:func:`artifact_key`):

- the versions of Python, torch and transformers, the CPU's vector instruction set (the code
  inductor wrote for it), the device;
- pagedkv's own source (every ``.py`` of the package: the attention function, the linears'
  modules and anything else the trace went through) and the source of the model's module
  (code loaded with ``trust_remote_code`` included);
- the model: its class, its config, its module tree (``repr``: layer types and shapes, so the
  linears pagedkv put in and a tensor-parallel shard's sizes) and its parameters' dtype;
- the call: the keyword arguments' names, dtypes and ranks (their sizes are symbolic);
- inductor's options and the rank in a tensor-parallel group.

The weights are *not* in the key: the forward takes them as inputs at every call, so one
artifact serves every checkpoint of a config (a frozen graph, whose weights are constants, is
never saved: :class:`~pagedkv.worker.compiled_forward.CompiledForward` compiles it the usual
way).

**Where.** ``<inductor's cache folder>/pagedkv/forward-<key>.bin`` (``TORCHINDUCTOR_CACHE_DIR``,
by default ``/tmp/torchinductor_<user>``), beside the compiled kernels the file refers to:
deleting that folder deletes both. The file is a pickle, read only from that folder, which is
the same trust boundary as inductor's own caches (they hold pickles and shared objects that
torch loads): whoever can write there can run code in the engine (docs/architecture.md).

**Failure.** A file that does not load (written by an interrupted process, a torch whose format
changed) is a warning, and the engine compiles again and replaces it. Writes go to a temporary
file renamed into place, so concurrent engines (tensor-parallel workers, two servers) never
read half a file.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import pagedkv

__all__ = ["artifact_dir", "artifact_key", "load_artifact", "save_artifact"]


def artifact_dir() -> Path:
    """``<inductor's cache folder>/pagedkv``: read at each call, so ``TORCHINDUCTOR_CACHE_DIR``
    set after import counts (as it does for inductor)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "pagedkv"


@functools.cache
def _package_source_digest() -> str:
    """SHA-256 over pagedkv's Python sources (path and bytes of each, in path order)."""
    root = Path(pagedkv.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _module_source_digest(cls: type) -> str:
    """SHA-256 of the file that defines ``cls`` ('' when it has none)."""
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:
        source = None
    if source is None or not os.path.isfile(source):
        return ""
    return hashlib.sha256(Path(source).read_bytes()).hexdigest()


def _tensor_parallel_rank() -> str:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"{torch.distributed.get_rank()}/{torch.distributed.get_world_size()}"
    return "-"


def artifact_key(model: torch.nn.Module, call: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    """The hex SHA-256 naming ``model``'s compiled forward for calls shaped like ``call`` (the
    step's keyword arguments) under inductor ``options`` (the module docstring lists what it
    covers and why)."""
    import transformers

    parameter = next(model.parameters(), None)
    config = getattr(model, "config", None)
    parts = [
        sys.version,
        torch.__version__,
        transformers.__version__,
        str(torch.backends.cpu.get_cpu_capability()),
        _package_source_digest(),
        f"{type(model).__module__}.{type(model).__qualname__}",
        _module_source_digest(type(model)),
        config.to_json_string() if config is not None else "",
        repr(model),
        f"{parameter.dtype} {parameter.device}" if parameter is not None else "",
        repr(
            sorted(
                (name, (str(value.dtype), value.dim()) if isinstance(value, torch.Tensor) else repr(value))
                for name, value in call.items()
            )
        ),
        repr(sorted(options.items())),
        _tensor_parallel_rank(),
    ]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def load_artifact(path: Path, f_globals: dict[str, Any]) -> Callable[..., Any] | None:
    """The forward saved at ``path``, or None when there is none or it does not load (a
    warning says why). ``f_globals``: the globals of the function that was captured."""
    try:
        with path.open("rb") as file:
            return torch.compiler.load_compiled_function(file, f_globals=f_globals)
    except FileNotFoundError:
        return None
    except Exception as exc:  # an unreadable artifact costs a compile, not the engine
        warnings.warn(
            f"compiled forward {path} did not load ({type(exc).__name__}: {exc}); compiling again", stacklevel=2
        )
        return None


def save_artifact(compiled: Any, path: Path, f_globals: dict[str, Any]) -> None:
    """Writes ``compiled`` (``aot_compile``'s result) to ``path``: to a temporary file in the same
    folder, read back with ``f_globals`` (a forward whose bytecode needs a global those lack
    would fail every later start's load), then renamed into place. A failure is a warning: the
    engine runs on with ``compiled``, and a restart compiles again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.close(fd)
        try:
            compiled.save_compiled_function(temporary)
            with open(temporary, "rb") as file:
                torch.compiler.load_compiled_function(file, f_globals=f_globals)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except Exception as exc:
        warnings.warn(f"compiled forward not saved to {path} ({type(exc).__name__}: {exc})", stacklevel=2)
