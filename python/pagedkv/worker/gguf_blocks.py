"""A GGUF model's quantized linear weights as the block kernel reads them: the file
``pagedkv_gguf_blocks.st`` (safetensors) beside the converted float32 folder's weights.

Written once, when a GGUF file is converted (pagedkv.worker.model_files), from the file and the
model transformers loaded from it: every 2-D tensor of a type the kernel reads
(:data:`~pagedkv.worker.gguf_linear.GGUF_BLOCK_FORMATS`) that transformers maps to a parameter
is stored under that parameter's name, its rows (blocks of one output row each) in the order the
model expects. transformers reorders some tensors' rows when it converts from GGUF (llama-family
Q/K projections: the reverse of the permutation llama.cpp's converter applies); the same row
order is found by running transformers' own tensor processor on a column of row numbers, and a
tensor it changes in any other way (a transpose, a value change, a split) is left out and served
as float32. Each kept tensor is checked against the loaded float32 weights (a sample of rows,
dequantized by ``gguf`` and compared exactly) before it is written.

Reading it back (:func:`load_gguf_blocks`) maps the file (safetensors), nothing dequantized.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: pagedkv.worker.model_files imports this module without torch
    import numpy as np
    import torch

__all__ = ["BLOCKS_FILE", "has_gguf_blocks", "load_gguf_blocks", "write_gguf_blocks"]

BLOCKS_FILE = "pagedkv_gguf_blocks.st"
_FORMAT = "pagedkv-gguf-blocks-1"
# Rows compared against the float32 model per tensor when the file is written.
_CHECKED_ROWS = 16


def has_gguf_blocks(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a blocks file with at least one tensor (an unreadable one counts
    as none, with a ``UserWarning``: the model is then served as float32)."""
    path = Path(folder) / BLOCKS_FILE
    if not path.is_file():
        return False
    try:
        return bool(_read_header(path)[1])
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own errors on a damaged file)
        warnings.warn(f"ignoring the unreadable GGUF blocks file {path} ({exc})", UserWarning, stacklevel=2)
        return False


def _read_header(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a pagedkv GGUF blocks file (format {metadata.get('format')!r})")
    return metadata, json.loads(metadata.get("types", "{}"))


def load_gguf_blocks(folder: str | os.PathLike[str]) -> dict[str, tuple[torch.Tensor, str]]:
    """Parameter name -> (uint8 blocks ``[N, row_bytes]``, GGUF type) from ``folder``'s blocks file."""
    from safetensors.torch import load_file

    path = Path(folder) / BLOCKS_FILE
    _, types = _read_header(path)
    tensors = load_file(str(path))
    return {name: (tensors[name], kind) for name, kind in types.items()}


def _row_order(processor: Any, name: str, rows: int) -> np.ndarray | None:
    """The row order transformers' ``processor`` gives tensor ``name``'s rows (``order[i]`` = the
    file's row at the model's row ``i``), or None if it does more than reorder rows."""
    import numpy as np

    probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    parsed: dict[str, Any] = {"tensors": {}}
    try:
        result = processor.process(weights=probe.copy(), name=name, tensor_key_mapping={}, parsed_parameters=parsed)
    except Exception:  # noqa: BLE001 (a processor that cannot handle a probe: keep the tensor float32)
        return None
    weights = getattr(result, "weights", None)
    if parsed["tensors"] or result.name != name or not isinstance(weights, np.ndarray) or weights.shape != (rows, 1):
        return None
    order = weights[:, 0]
    if not np.array_equal(np.sort(order), probe[:, 0]):
        return None
    return order.astype(np.int64)


def write_gguf_blocks(gguf_path: str | os.PathLike[str], model: Any, folder: str | os.PathLike[str]) -> int:
    """Writes ``folder``'s blocks file from the GGUF file and ``model`` (the float32 model
    transformers loaded from it); returns the number of tensors stored (0 still writes a file:
    the GGUF has nothing the kernel reads). Atomic: a temporary file renamed into place."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from pagedkv.worker.gguf_linear import GGUF_BLOCK_FORMATS

    reader = GGUFReader(str(gguf_path))
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())  # type: ignore[no-untyped-call]
    mapping = get_gguf_hf_weights_map(model, processor)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for tensor in reader.tensors:
        kind = GGMLQuantizationType(tensor.tensor_type).name
        hf_name = mapping.get(tensor.name)
        if kind not in GGUF_BLOCK_FORMATS or hf_name is None or hf_name not in state or len(tensor.shape) != 2:
            continue
        data = np.asarray(tensor.data)
        rows = data.shape[0]
        target = state[hf_name]
        if target.dim() != 2 or tuple(target.shape) != (rows, int(tensor.shape[0])):
            continue
        order = _row_order(processor, tensor.name, rows)
        if order is None:
            continue
        blocks = np.ascontiguousarray(data[order])
        sample = np.unique(np.linspace(0, rows - 1, min(rows, _CHECKED_ROWS)).astype(np.int64))
        want = target[torch.from_numpy(sample)].float().numpy()
        if not np.array_equal(dequantize(blocks[sample], tensor.tensor_type).astype(np.float32), want):
            continue  # not the rows the model holds: served as float32
        tensors[hf_name] = torch.from_numpy(blocks)
        types[hf_name] = kind
    metadata = {"format": _FORMAT, "types": json.dumps(types, sort_keys=True), "source": Path(gguf_path).name}
    folder = Path(folder)
    fd, tmp = tempfile.mkstemp(prefix=f".{BLOCKS_FILE}.", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, folder / BLOCKS_FILE)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return len(tensors)
