"""Static KV-cache scales from a checkpoint (``kv_cache_scales="checkpoint"``).

Quantized checkpoints made for fp8 KV caches (vLLM's convention, e.g. llm-compressor output)
carry one ``k_scale`` and one ``v_scale`` tensor per attention layer, named
``model.layers.<i>.self_attn.k_scale`` (a scalar, or one value per KV head). transformers
ignores those names when it loads the model, so they are read here straight from the
checkpoint's ``*.safetensors`` files (only the scale tensors are loaded).

Every problem is a :class:`pagedkv.errors.ModelLoadError` raised before the KV cache is
allocated: no scale in the checkpoint, a layer without one, a layer index past the model's
layers, a scale that is not finite and positive or has the wrong shape.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pagedkv.errors import InvalidArgumentError, ModelLoadError
from pagedkv.kernels.kv_quant import check_static_scale

__all__ = ["load_checkpoint_kv_scales"]

# "...layers.<i>.<anything>.k_scale" / "v_scale": self_attn.k_scale, attn.k_scale, ...
_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[\w.]+\.)?([kv])_scale$")


def load_checkpoint_kv_scales(
    model_path: str, num_layers: int, num_kv_heads: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # per layer: [Hkv] float32 K scales, V scales
    """The checkpoint's static K and V scales per layer, each ``[num_kv_heads]`` float32."""
    from safetensors import safe_open

    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise ModelLoadError(
            f"kv_cache_scales='checkpoint' needs a local checkpoint folder with *.safetensors files; "
            f"{model_path!r} has none (use kv_cache_scales='dynamic', which needs no scales)"
        )
    found: dict[tuple[str, int], torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    match = _SCALE_NAME.search(name)
                    if match is None:
                        continue
                    layer, kind = int(match.group(1)), match.group(2)
                    if layer >= num_layers:
                        raise ModelLoadError(
                            f"{file.name}: {name} is a KV scale for layer {layer}, but the model has "
                            f"{num_layers} layers (scales from another checkpoint?)"
                        )
                    try:
                        found[(kind, layer)] = check_static_scale(name, handle.get_tensor(name), num_kv_heads)
                    except InvalidArgumentError as exc:
                        raise ModelLoadError(f"{file.name}: {exc}") from exc
        except (OSError, ValueError, RuntimeError) as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot read KV scales from {file}: {exc}") from exc
    if not found:
        raise ModelLoadError(
            f"kv_cache_scales='checkpoint', but the checkpoint {model_path!r} has no k_scale / v_scale tensors "
            "(use kv_cache_scales='dynamic', which needs no scales)"
        )
    missing = [
        f"{kind}_scale of layer {layer}" for kind in "kv" for layer in range(num_layers) if (kind, layer) not in found
    ]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelLoadError(f"the checkpoint {model_path!r} has KV scales for some layers but not {shown}")
    return [found[("k", i)] for i in range(num_layers)], [found[("v", i)] for i in range(num_layers)]
