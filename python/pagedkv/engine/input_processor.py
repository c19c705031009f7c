"""The input processor: a request as a caller gives it, checked against the engine's model and
configuration and turned into what the engine keeps of it (:class:`RequestState`) and what the
scheduler is told (:class:`NewRequest`).

Everything that can refuse a request on the Python side runs here, before anything changes
(typed :mod:`pagedkv.errors` exceptions), and everything the request needs later (token ids,
prepared sampling structures, generators, detokenizers, a beam tracker) is built here, so a
request the scheduler accepts can always be stepped. The scheduler's own checks run when the
request is added to it (``Admission.add``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.distributed.transfer_config import RemotePrefill, parse_kv_transfer_params
from pagedkv.engine.beam_tracker import BeamTracker
from pagedkv.engine.prompts import PromptType, to_token_ids
from pagedkv.engine.request_state import RequestState
from pagedkv.errors import ConfigError, InvalidArgumentError, InvalidTypeError, KVTransferError
from pagedkv.sample.beam_search_params import BeamSearchParams
from pagedkv.sample.prepared import PreparedSampling, prepare_sampling
from pagedkv.sample.sampling_params import SamplingParams
from pagedkv.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedkv.config import EngineConfig
    from pagedkv.distributed.connector import KVConnector
    from pagedkv.worker.model_runner import ModelRunner

__all__ = ["InputProcessor", "NewRequest", "request_ids"]

logger = logging.getLogger(__name__)


@dataclass
class NewRequest:
    """A checked request, ready to be added to the scheduler (vLLM's ``EngineCoreRequest``)."""

    state: RequestState
    # The generation limit the scheduler enforces (max_tokens, or what max_model_len leaves).
    max_tokens: int
    # Lower is served first under scheduling_policy="priority".
    priority: int
    # The beam search's parameters; None for a sampled request.
    beam: BeamSearchParams | None
    # The structured-output constraint whose grammar must compile before it is scheduled.
    constraint: StructuredOutputsParams | None
    # The remote prefill asked for (kv_transfer_params with do_remote_prefill), unchecked
    # against the connector's KV format yet (InputProcessor.check_remote_prefill).
    remote: RemotePrefill | None

    @property
    def request_id(self) -> str:
        return self.state.request_id


class InputProcessor:
    """Checks and builds new requests for one engine (its model, tokenizer and connector)."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        runner: ModelRunner,
        eos_token_ids: list[int],
        kv_connector: KVConnector | None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = runner.vocab_size
        self.device = runner.device
        self.max_model_len = runner.max_model_len
        self.eos_token_ids = eos_token_ids
        self.kv_connector = kv_connector

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
        kv_transfer_params: dict[str, Any] | None,
        prepared: PreparedSampling | None,
    ) -> NewRequest:
        """The request ``LLMEngine.add_request`` was given, checked and built (see there)."""
        if not isinstance(request_id, str):
            raise InvalidTypeError(f"request_id must be a str, got {type(request_id).__name__}")
        beam: BeamSearchParams | None = None
        if params is None:
            params = SamplingParams()
        elif isinstance(params, BeamSearchParams):
            if kv_transfer_params is not None:
                raise InvalidArgumentError("kv_transfer_params cannot be combined with beam search")
            beam = params
            self._check_num_samples(beam.beam_width, "beam_width")
            params = SamplingParams(n=1, max_tokens=beam.max_tokens, temperature=0.0, ignore_eos=beam.ignore_eos)
        elif not isinstance(params, SamplingParams):
            raise InvalidTypeError(
                f"params must be a SamplingParams or a BeamSearchParams, got {type(params).__name__}"
            )
        if arrival_time is not None and not isinstance(arrival_time, (int, float)):
            raise InvalidTypeError(f"arrival_time must be a number or None, got {type(arrival_time).__name__}")
        self._check_params_for_model(params)
        if prepared is None or not prepared.fits(params, self.vocab_size, self.device):
            prepared = self.prepare_params(params)
        transfer = self._check_kv_transfer_params(kv_transfer_params)
        if isinstance(transfer, RemotePrefill) and params.prompt_logprobs is not None:
            raise InvalidArgumentError(
                "prompt_logprobs cannot be combined with a remote prefill: the prompt's KV arrives without its logits"
            )
        text, prompt_ids = to_token_ids(prompt, self.tokenizer, self.vocab_size)
        state = RequestState(request_id, text, prompt_ids, params, self.tokenizer, self.device, arrival_time, prepared)
        state.hold_kv = transfer is True
        state.cache_salt = cache_salt
        if beam is not None:
            state.beam = BeamTracker(beam, self.tokenizer, self.eos_token_ids)
        max_tokens = (
            params.max_tokens if params.max_tokens is not None else max(1, self.max_model_len - len(prompt_ids))
        )
        return NewRequest(
            state=state,
            max_tokens=max_tokens,
            priority=priority,
            beam=beam,
            constraint=params.structured_outputs if beam is None else beam.structured_outputs,
            remote=transfer if isinstance(transfer, RemotePrefill) else None,
        )

    def prepare_params(self, params: SamplingParams) -> PreparedSampling:
        """What ``params`` need at every step, checked against the model and built once (see
        ``LLMEngine.prepare_params``). Reads only the tokenizer and the vocabulary: thread-safe."""
        if not isinstance(params, SamplingParams):
            raise InvalidTypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        return prepare_sampling(
            params,
            vocab_size=self.vocab_size,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
        )

    def check_remote_prefill(self, request: NewRequest) -> RemotePrefill | None:
        """The pull ``request`` waits for, checked before it is added (``KVConnector.check_load``),
        or None when its prompt is computed here: no pull asked for, or one refused under the
        ``recompute`` policy (another KV format; under ``fail`` it raises). Called under the
        engine's lock (the connector's control thread changes what it checks)."""
        remote = request.remote
        if remote is None:
            return None
        connector = self.kv_connector
        assert connector is not None  # _check_kv_transfer_params refused it otherwise
        try:
            connector.check_load(request.state.prompt_token_ids, remote)
        except KVTransferError as exc:  # refused before anything moved (another KV format)
            if connector.config.kv_load_failure_policy == "fail":
                raise
            logger.warning("request %r: %s; its prompt is computed here", request.request_id, exc)
            return None
        return remote

    def _check_kv_transfer_params(self, kv_transfer_params: Any) -> bool | RemotePrefill | None:
        """The parsed params (see ``parse_kv_transfer_params``), refused on an engine whose
        ``kv_transfer_config`` cannot serve them."""
        transfer = parse_kv_transfer_params(kv_transfer_params)
        if transfer is None:
            return None
        connector = self.kv_connector
        if connector is None:
            raise InvalidArgumentError("kv_transfer_params need an engine started with kv_transfer_config")
        if transfer is True and not connector.config.is_producer:
            raise InvalidArgumentError("do_remote_decode needs a KV producer (kv_transfer_config.role)")
        if isinstance(transfer, RemotePrefill) and not connector.config.is_consumer:
            raise InvalidArgumentError("do_remote_prefill needs a KV consumer (kv_transfer_config.role)")
        return transfer

    def _check_num_samples(self, num: int, name: str) -> None:
        """A request's samples (or beams) all run in one step: more than ``max_num_seqs`` could
        never be scheduled. Checked before any per-sample state is built (``n = 10**9`` must
        not allocate a billion detokenizers to be refused)."""
        limit = self.config.scheduling.max_num_seqs
        if num > limit:
            raise InvalidArgumentError(f"{name} = {num} exceeds max_num_seqs = {limit}: its sequences could never run")

    def _check_params_for_model(self, params: SamplingParams) -> None:
        """The checks of ``params`` that need the engine's configuration or the model (its
        vocabulary), before any per-request state is built. Token ids are checked against the
        vocabulary by prepare_params (once, C-speed)."""
        self._check_num_samples(params.n, "n")
        max_logprobs = self.config.model.max_logprobs
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise ConfigError(
                f"logprobs = {params.logprobs} exceeds max_logprobs = {max_logprobs} (an engine argument)"
            )
        vocab = self.vocab_size
        if params.logprobs is not None and params.logprobs > vocab:
            raise ConfigError(f"logprobs must be <= the vocabulary size {vocab}, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > min(max_logprobs, vocab):
            raise ConfigError(
                f"prompt_logprobs = {params.prompt_logprobs} exceeds max_logprobs = {max_logprobs} "
                "(an engine argument) or the vocabulary"
            )


def request_ids(request_id: str | Iterable[str]) -> list[str]:
    """One request id or an iterable of them, as a list of distinct ids in order (InvalidTypeError
    on anything else)."""
    if isinstance(request_id, str):
        return [request_id]
    if not isinstance(request_id, Iterable) or isinstance(request_id, (bytes, dict)):
        raise InvalidTypeError(f"request_id must be a str or an iterable of str, got {type(request_id).__name__}")
    ids = list(dict.fromkeys(request_id))  # each id once, in order
    bad = [rid for rid in ids if not isinstance(rid, str)]
    if bad:
        raise InvalidTypeError(f"request ids must be str, got {bad[0]!r} ({type(bad[0]).__name__})")
    return ids
