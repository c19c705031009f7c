"""Structured outputs: JSON schemas, regexes, choices and grammars enforced token by token.

- :mod:`~pagedkv.structured.params`: :class:`StructuredOutputsParams`, the request's constraint;
- :mod:`~pagedkv.structured.limits`: what a constraint may cost, checked on its text before it
  compiles (rule chains, alternatives, counted repetitions, schema nesting), and llguidance's fuel;
- :mod:`~pagedkv.structured.compiler`: grammars compiled off the engine thread in a bounded,
  cancellable pool, proven usable before a request is admitted, cached;
- :mod:`~pagedkv.structured.step_masks`: a step's masks, filled while the forward runs;
- :mod:`~pagedkv.structured.stats`: compile and mask time histograms for ``/metrics``.

The grammar engine is llguidance (its Python package, a Rust core). Why the matchers live in
Python next to the sampler, not in the Rust scheduler: docs/engine.md, "Structured outputs".
"""

from pagedkv.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
