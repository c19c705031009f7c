"""``BeamSearchParams``: the parameters of one beam search, with vLLM's names and defaults.

Beam search keeps the ``beam_width`` most likely continuations (by cumulative log-probability)
at every step and returns the best ``beam_width`` finished sequences; the scheduler runs the
beams natively on copy-on-write KV blocks (see ``pagedkv.scheduler`` docs in
docs/core.md, "Beam search").
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import ConfigError
from pagedkv.sample.sampling_params import _check_bool, _check_float, _check_int, check_structured_outputs
from pagedkv.structured.params import StructuredOutputsParams

__all__ = ["BeamSearchParams"]


@dataclass
class BeamSearchParams:
    """Beam-search parameters (vLLM's ``BeamSearchParams``).

    - ``beam_width``: live beams kept per step, and sequences returned (>= 1, at most the
      engine's ``max_num_seqs``).
    - ``max_tokens``: most tokens generated per sequence (>= 1).
    - ``ignore_eos``: keep generating after eos (sequences then all have ``max_tokens`` tokens).
    - ``temperature``: must be 0: beams are ranked by the log-probabilities of the model's own
      distribution (a temperature-scaled search is not supported).
    - ``length_penalty``: a finished sequence's score is ``cumulative_logprob / len **
      length_penalty`` (1.0 averages per token, 0.0 sums, larger values favour longer outputs);
      finite.
    - ``include_stop_str_in_output``: keep the eos token's text in ``text`` (vLLM's name; the
      token itself is always in ``tokens``).
    - ``structured_outputs``: every beam must match this constraint
      (:class:`~pagedkv.structured.StructuredOutputsParams` or a dict of its fields): candidates
      are drawn from the masked log-probabilities, and each beam's matcher follows it.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.beam_width = _check_int("beam_width", self.beam_width, minimum=1)
        self.max_tokens = _check_int("max_tokens", self.max_tokens, minimum=1)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature != 0.0:
            raise ConfigError(
                f"beam search supports only temperature=0 (beams are ranked by the model's own "
                f"log-probabilities), got temperature={self.temperature}"
            )
        self.length_penalty = _check_float("length_penalty", self.length_penalty)
        self.include_stop_str_in_output = _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.structured_outputs = check_structured_outputs(self.structured_outputs)
