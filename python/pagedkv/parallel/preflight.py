"""Checks a tensor-parallel configuration before any worker or Ray starts, so a request that
cannot work fails at once with what to change (not after a placement or rendezvous timeout).

- The model: its attention heads, KV heads and MLP width must divide by ``tensor_parallel_size``
  (read from its config alone: no weights load).
- The machine: ``mp`` on CUDA needs a visible device per rank; Ray needs a bundle per worker rank
  (``{"GPU": 1}`` or ``{"CPU": 1}``) among the cluster's resources when the engine starts.
"""

from __future__ import annotations

from typing import Any

from pagedkv.errors import ConfigError, ModelLoadError
from pagedkv.parallel.sharding import check_tensor_parallel_size

__all__ = ["check_model_divides", "check_ray_resources", "worker_bundle"]


def check_model_divides(model_config: Any, n: int) -> None:
    """ConfigError unless the model's heads, KV heads and MLP width divide by ``n``."""
    from transformers import AutoConfig

    from pagedkv.worker.model_files import resolve_model

    path = resolve_model(model_config.model)
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the config of model {path!r}: {exc}") from exc
    check_tensor_parallel_size(hf_config.get_text_config(), n)


def worker_bundle(on_cuda: bool) -> dict[str, float]:
    """The Ray resources one worker rank takes (rank 0 is the engine's own process)."""
    return {"GPU": 1} if on_cuda else {"CPU": 1}


def check_ray_resources(cluster_resources: dict[str, float], n: int, on_cuda: bool) -> None:
    """ConfigError unless the Ray cluster has the resources of ``n - 1`` worker bundles."""
    [(kind, each)] = worker_bundle(on_cuda).items()
    needed = (n - 1) * each
    have = cluster_resources.get(kind, 0.0)
    if have < needed:
        raise ConfigError(
            f"tensor_parallel_size={n} on Ray needs {needed:g} {kind} for its {n - 1} worker ranks "
            f"(one each; rank 0 is this process); the Ray cluster has {have:g}"
        )
