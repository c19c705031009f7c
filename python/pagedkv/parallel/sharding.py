"""Splitting a loaded model across tensor-parallel ranks, Megatron style.

Each decoder layer's Q/K/V and gate/up projections are **column-parallel** (rank r keeps rows
``r*k .. (r+1)*k`` of the weight: its share of the heads / MLP columns, no communication), O
and down are **row-parallel** (rank r keeps the matching input columns; the partial outputs
are summed with one all-reduce, then the bias is added once). Rank r thus holds query heads
``[r*H/N, (r+1)*H/N)`` and KV heads ``[r*Hkv/N, (r+1)*Hkv/N)``: with both divisible by N a
query head's KV head lands on the same rank, so attention needs no communication and the
paged KV cache of every rank holds ``Hkv / N`` heads in identically numbered blocks.

The embedding and the LM head stay **replicated**: for the models this targets they are a
small share of the weights (SmolLM2-135M: 28 MB of 540), and a vocabulary-parallel head would
add an all-gather of the logits to every step.

Which linear is which comes from the model's own tensor-parallel plan
(``config.base_model_tp_plan``, transformers' ``"colwise"`` / ``"rowwise"`` entries) where it
ships one, else from pagedkv's plan for Llama-family models (the same names).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from pagedkv.errors import ConfigError, UnsupportedModelError
from pagedkv.parallel.group import TPGroup

__all__ = ["LLAMA_TP_PLAN", "RowParallelLinear", "check_tensor_parallel_size", "shard_model", "tp_plan_of"]

# pagedkv's plan for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM, ...).
LLAMA_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def tp_plan_of(config: Any) -> dict[str, str]:
    """The model's own plan (``base_model_tp_plan``) if it has one, else pagedkv's Llama plan."""
    plan = getattr(config, "base_model_tp_plan", None)
    return dict(plan) if plan else dict(LLAMA_TP_PLAN)


def check_tensor_parallel_size(config: Any, n: int) -> None:
    """ConfigError unless the heads, KV heads and MLP width all divide by ``n`` (naming the
    sizes that would work)."""
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    inter = int(getattr(config, "intermediate_size", 0) or 0)
    sizes = {"attention heads": heads, "KV heads": kv_heads, "MLP width (intermediate_size)": inter}
    if heads <= 0 or inter <= 0:
        raise UnsupportedModelError("tensor parallelism needs num_attention_heads and intermediate_size in the config")
    bad = [f"{name} {size}" for name, size in sizes.items() if size % n]
    if bad:
        ok = [d for d in range(1, kv_heads + 1) if all(size % d == 0 for size in sizes.values())]
        raise ConfigError(
            f"tensor_parallel_size={n} does not divide the model's {', '.join(bad)}; "
            f"sizes that work for this model: {ok}"
        )


class RowParallelLinear(nn.Module):
    """A row-parallel shard of a linear layer: ``y = all_reduce(x @ W_r.T) + b`` where ``W_r``
    is this rank's ``[out, in / N]`` slice and ``x`` this rank's ``[..., in / N]`` activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _column_shard(linear: nn.Linear, rank: int, n: int) -> nn.Linear:
    out = linear.out_features // n
    rows = slice(rank * out, (rank + 1) * out)
    shard = nn.Linear(linear.in_features, out, bias=linear.bias is not None, device="meta")
    shard.weight = nn.Parameter(linear.weight.data[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        shard.bias = nn.Parameter(linear.bias.data[rows].clone(), requires_grad=False)
    return shard


def _row_shard(linear: nn.Linear, group: TPGroup) -> RowParallelLinear:
    width = linear.in_features // group.world_size
    cols = slice(group.rank * width, (group.rank + 1) * width)
    bias = None if linear.bias is None else linear.bias.data.clone()
    return RowParallelLinear(linear.weight.data[:, cols].clone(), bias, group)


@torch.inference_mode()
def shard_model(model: nn.Module, group: TPGroup) -> int:
    """Replaces, in place, every linear the plan names by this rank's shard; returns how many.
    UnsupportedModelError if the plan matches no linear (the model's layout is not the plan's)."""
    config: Any = model.config
    plan = tp_plan_of(config.get_text_config())
    base: nn.Module = getattr(model, "base_model", model)
    n, rank = group.world_size, group.rank
    replaced = 0
    for name, module in list(base.named_modules()):
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None or not isinstance(module, nn.Linear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = base.get_submodule(parent_name) if parent_name else base
        if style.startswith("colwise"):
            if module.out_features % n:
                raise ConfigError(f"{name}: {module.out_features} output features do not divide by {n}")
            setattr(parent, child, _column_shard(module, rank, n))
        elif style.startswith("rowwise"):
            if module.in_features % n:
                raise ConfigError(f"{name}: {module.in_features} input features do not divide by {n}")
            setattr(parent, child, _row_shard(module, group))
        else:
            continue  # another style (e.g. replicated): left whole
        replaced += 1
    if replaced == 0:
        raise UnsupportedModelError(
            f"the tensor-parallel plan {sorted(plan)} matches no linear layer of {type(model).__name__}"
        )
    return replaced
