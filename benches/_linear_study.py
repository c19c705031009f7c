"""Why a linear call costs more inside the model than in a tight loop: each candidate cause
measured alone on the model's own weights (benches/profile_step.py ``--linear``).

A decode step at batch 1 multiplies one row by every weight matrix once: 210 linears of 30
layers (q, k, v, o, gate, up, down), ~425 MB of float32 for SmolLM2-135M, far more than the
CPU's caches, so each call streams its weight from memory. The variants below change one
thing at a time against ``layer order`` (the model's weights in the order the forward uses
them, ``F.linear`` on a ``[1, 1, K]`` row under ``inference_mode``, as the model calls them):

* ``same weight (cache-hot)``: one weight called again and again, what a microbenchmark of one
  shape measures;
* ``2-D input``: ``[1, K]`` instead of ``[1, 1, K]``;
* ``1 thread``: ``torch.set_num_threads(1)``;
* ``grad mode``: autograd on (the weights require grad: every call records a graph node);
* ``nn.Linear modules``: the modules' ``__call__`` instead of ``F.linear``;
* ``small ops between``: two elementwise ops on the row after each call, as the model's norms
  and residuals do, which let the OpenMP threads fall asleep between calls;
* ``weights pre-transposed``: ``x @ Wt`` with ``Wt = W.t().contiguous()`` (``[K, N]``);
* ``oneDNN, prepacked``: oneDNN's product on its blocked weight layout, on torch's threads and
  on one thread (what ``linear_kernel="onednn"`` runs for one row: pagedkv.worker.onednn_linear);
* ``read bandwidth``: ``W.sum()`` over the same weights: what reading them costs at least.

The OpenMP wait policy cannot change inside a process: the parent runs the same loop in a
child with ``OMP_WAIT_POLICY`` unset (``wait_policy_child``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_linears(model: Any) -> list[torch.nn.Linear]:
    """The decoder layers' linears in forward order (the LM head excluded)."""
    layers = model.model.layers
    return [getattr(layer.self_attn if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp, n)
            for layer in layers for n in _PROJECTIONS]  # fmt: skip


def linear_variants(model: Any) -> dict[str, Callable[[], object]]:
    """One pass over the model's linears per variant (see the module docstring)."""
    linears = model_linears(model)
    weights = [lin.weight.detach() for lin in linears]
    rows3 = [torch.randn(1, 1, w.shape[1]) for w in weights]
    rows2 = [r[0] for r in rows3]
    transposed = [w.t().contiguous() for w in weights]
    hot = weights[4]  # gate_proj of layer 0, [1536, 576]
    hot_row = rows3[4]
    grad_weights = [w.clone().requires_grad_(True) for w in weights]

    def layer_order() -> None:
        for x, w in zip(rows3, weights):
            F.linear(x, w)

    def same_weight() -> None:
        for _ in weights:
            F.linear(hot_row, hot)

    def two_d() -> None:
        for x, w in zip(rows2, weights):
            F.linear(x, w)

    def one_thread() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            layer_order()
        finally:
            torch.set_num_threads(threads)

    def grad_mode() -> None:
        with torch.inference_mode(False), torch.enable_grad():
            for x, w in zip(rows3, grad_weights):
                F.linear(x.clone(), w)

    def modules() -> None:
        for x, lin in zip(rows3, linears):
            lin(x)

    def small_ops() -> None:
        for x, w in zip(rows3, weights):
            y = F.linear(x, w)
            y = y * 2.0
            y + 1.0

    def pre_transposed() -> None:
        for x, wt in zip(rows3, transposed):
            torch.matmul(x, wt)

    packed = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16) for w in weights]

    def onednn() -> None:
        for x, p in zip(rows3, packed):
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")

    def onednn_one_thread() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            onednn()
        finally:
            torch.set_num_threads(threads)

    def read_bandwidth() -> None:
        for w in weights:
            w.sum()

    return {
        "layer order (as the model calls)": layer_order,
        "same weight (cache-hot)": same_weight,
        "2-D input": two_d,
        "1 thread": one_thread,
        "grad mode (autograd on)": grad_mode,
        "nn.Linear modules": modules,
        "small ops between": small_ops,
        "weights pre-transposed (x @ Wt)": pre_transposed,
        "oneDNN, prepacked": onednn,
        "oneDNN, prepacked, 1 thread (linear_kernel='onednn' at one row)": onednn_one_thread,
        "read bandwidth (W.sum)": read_bandwidth,
    }


def run_linear_study(model: Any, rounds: int = 15) -> dict[str, float]:
    """ms per linear call of each variant, interleaved: round r runs every variant once."""
    variants = linear_variants(model)
    calls = len(model_linears(model))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for fn in variants.values():
            fn()  # warm-up
        for _ in range(rounds):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def weight_bytes(model: Any) -> int:
    return sum(lin.weight.numel() * lin.weight.element_size() for lin in model_linears(model))
