"""The model's linears through oneDNN with prepacked weights (``linear_kernel="onednn"``).

On the CPU, torch multiplies float32 matrices with MKL. On this project's AMD EPYC machines
MKL takes its AVX2 path, and a linear over 16-64 rows (a decode batch) is compute-bound there,
where oneDNN (AVX-512, weights reordered once into its blocked layout) runs it well over twice
as fast. One row is memory-bound: there oneDNN runs on one thread, which streams the weights
faster than MKL (``_ONE_ROW_THREADS``). benches/RESULTS.md, "Decode step profile", has the
engine's step with both.

The price: oneDNN sums in another order than MKL, so logits differ from the default path's in
the last bits (about 1e-6 relative): greedy tokens can differ at a near-tie, which is why
this is an option and not the default (tests/kernels/test_onednn_linear.py checks greedy equality with
transformers on the test prompts). Memory: the packed copies sit beside the model's own
weights (which stay: the embedding tied to the LM head, the prompt-logprob head split and the
state dict read them), so the linears' weights take twice their size.

Each ``nn.Linear`` (exactly that class; subclasses keep their own forward) of a float32 model
on the CPU is switched to :class:`_OneDNNLinear` in place: same parameters, same hooks, a
``forward`` that calls ``torch.ops.mkldnn._linear_pointwise`` on the packed weight.
:attr:`OneDNNLinears.enabled` switches all of them back to ``F.linear`` at once (benchmarks).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from pagedkv.errors import ConfigError
from pagedkv.worker.cpu_linear import LinearSwitch

__all__ = ["OneDNNLinears", "onednn_available", "use_onednn_linears"]

# The row count oneDNN lays the packed weights out for (a decode batch); any row count runs.
_PACK_ROWS = 16
# One row (a batch-1 decode step) is memory-bound, and one core reads the weights about as
# fast as two can on the machines measured (oneDNN on one thread streamed the weights faster
# than on two, and faster than MKL), and a two-thread one-row product also pays a fork and
# join per call (benches/RESULTS.md, "Decode step profile"). So a one-row product
# runs with torch's thread count set to this around the call (process-wide: the engine's step
# is the only torch work of a serving process while it runs).
_ONE_ROW_THREADS = 1


def onednn_available() -> bool:
    available = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    return available and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# The switched linears; ``enabled = False`` runs them through ``F.linear`` again.
OneDNNLinears = LinearSwitch


class _OneDNNLinear(torch.nn.Linear):
    _packed: torch.Tensor  # oneDNN's blocked layout of ``weight`` [N, K]
    _switch: OneDNNLinears

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if not self._switch.enabled or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor
        if x.numel() != x.shape[-1]:
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [None], "")
            return out
        threads = torch.get_num_threads()  # one row: see _ONE_ROW_THREADS
        torch.set_num_threads(_ONE_ROW_THREADS)
        try:
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [None], "")
            return out
        finally:
            torch.set_num_threads(threads)


@torch.no_grad()
def use_onednn_linears(model: torch.nn.Module) -> OneDNNLinears:
    """Switches every plain float32 CPU ``nn.Linear`` of ``model`` to oneDNN (in place)."""
    if not onednn_available():
        raise ConfigError("linear_kernel='onednn' needs torch built with oneDNN (mkldnn), which this one is not")
    switch = OneDNNLinears()
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS)
        module.__class__ = _OneDNNLinear
        switched = cast(_OneDNNLinear, module)
        switched._packed = packed
        switched._switch = switch
        switch.modules.append(switched)
    return switch
