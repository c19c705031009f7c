"""Speculative decoding with a draft model (``speculative_config={"method": "draft_model",
"model": ..., "num_speculative_tokens": k}``): a smaller model with the target's vocabulary,
on its own paged KV, drafts ``k`` tokens per step for the samples that speculate.

The draft model is served the way the target is, by the same parts: its own
:class:`~pagedkv.worker.model_runner.ModelRunner` (weights, KV pool) and its own Rust
``Scheduler`` with prefix caching. After each target step, every sample still decoding becomes
one draft request: its tokens so far as the prompt, ``k`` greedy tokens to generate. The draft
scheduler finds the sample's earlier draft work in its prefix cache (every full block of it),
so only the last partial block and the tokens emitted since are computed, then ``k`` draft
steps, batched over the samples, produce the drafts, which the target scheduler gets through
``Scheduler.set_drafts`` and verifies in the next step that schedules the sample. A greedy draft
is a point mass, and the target's verification of point-mass drafts is exact
(docs/engine.md, "Speculative decoding"). The draft pool is a quarter of the target's KV
bytes (at least 16 MiB); when it runs short the draft scheduler preempts, as any scheduler does,
and drafting only gets slower. A failure while drafting costs the drafts of that step, never
the target's step: it is logged, the draft requests are dropped, and the target goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pagedkv._core import RequestUpdate, Scheduler, SchedulerConfig
from pagedkv.config import CacheConfig, ModelConfig, SchedulingConfig, SpeculativeConfig
from pagedkv.errors import ConfigError
from pagedkv.worker.model_runner import ModelRunner, load_model_config

if TYPE_CHECKING:
    from pagedkv.engine.request_state import RequestState

__all__ = ["DraftModelProposer", "check_draft_vocabulary"]

logger = logging.getLogger(__name__)

# The draft pool: this fraction of the target's KV bytes, at least the floor.
_DRAFT_KV_FRACTION = 0.25
_DRAFT_KV_FLOOR = 16 << 20


def check_draft_vocabulary(spec: SpeculativeConfig, target: ModelConfig) -> None:
    """Raises ConfigError when the draft model's vocabulary is not the target's (their configs'
    ``vocab_size``), reading only the two configs: before any weights load."""
    assert spec.model is not None
    target_config = load_model_config(target.model, target.trust_remote_code).get_text_config()
    draft_config = load_model_config(spec.model, target.trust_remote_code).get_text_config()
    if draft_config.vocab_size != target_config.vocab_size:
        raise ConfigError(
            f"speculative_config: the draft model {spec.model!r} has a vocabulary of {draft_config.vocab_size} "
            f"tokens, the target {target_config.vocab_size}: a draft model must share the target's vocabulary"
        )


class DraftModelProposer:
    """Drafts for the target's samples from a draft model (module docs)."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        target: ModelConfig,
        scheduling: SchedulingConfig,
        *,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        target_kv_bytes: int,
    ) -> None:
        assert spec.model is not None and spec.num_speculative_tokens is not None
        self.k: int = spec.num_speculative_tokens
        model = ModelConfig(
            model=spec.model,
            dtype=target.dtype,
            device=target.device,
            max_model_len=max_model_len,
            attention_backend=target.attention_backend,
            trust_remote_code=target.trust_remote_code,
            # Eager: a draft model is small next to its target, and compiling it too would
            # add a second compile to the engine's first start.
            enforce_eager=True,
        )
        memory = max(int(target_kv_bytes * _DRAFT_KV_FRACTION), _DRAFT_KV_FLOOR)
        # The draft pool has no host tier: its scheduler preempts by recompute whatever the target does.
        draft_scheduling = dataclasses.replace(scheduling, preemption_mode="recompute")
        self.runner = ModelRunner(model, CacheConfig(block_size=block_size, kv_cache_memory=memory), draft_scheduling)
        if self.runner.vocab_size != vocab_size:
            raise ConfigError(
                f"speculative_config: the draft model's LM head has {self.runner.vocab_size} rows, the target's "
                f"{vocab_size}: a draft model must share the target's vocabulary"
            )
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_blocks,
                block_size=self.runner.block_size,
                max_model_len=max_model_len,
                max_num_seqs=scheduling.max_num_seqs,
                max_num_batched_tokens=scheduling.max_num_batched_tokens,
                enable_prefix_caching=True,
            )
        )
        self.num_steps = 0
        self.seconds = 0.0

    def propose_after_step(
        self, target: Scheduler, updates: Sequence[RequestUpdate], requests: Mapping[str, RequestState]
    ) -> None:
        """The drafts for every sample still decoding after a target step (its ``updates``),
        handed to the ``target`` scheduler for the next step that schedules the sample."""
        samples: dict[tuple[str, int], tuple[list[int], str | None]] = {}
        for u in updates:
            state = requests.get(u.request_id)
            if state is None or state.beam is not None or state.grammar is not None:
                continue  # gone, or a request that never drafts
            sample = state.samples[u.index]
            if sample.finish_reason is None:
                samples[(u.request_id, u.index)] = (state.prompt_token_ids + sample.token_ids, state.cache_salt)
        # As many drafts as the cost model would verify now (none at a large batch: then the
        # draft model does not run at all).
        k = target.spec_drafts_worth()
        if not samples or k == 0:
            return
        proposed = self.propose([(rid, i, tokens, salt) for (rid, i), (tokens, salt) in samples.items()], k)
        for (rid, index), draft in proposed.items():
            target.set_drafts(rid, index, len(samples[(rid, index)][0]), draft)

    def propose(
        self, samples: list[tuple[str, int, list[int], str | None]], k: int
    ) -> dict[tuple[str, int], list[int]]:
        """Greedy drafts (up to ``k``, at most ``num_speculative_tokens``, each) for
        ``(request_id, index, tokens, cache_salt)`` samples, by ``(request_id, index)``: the
        draft model's prefix cache is keyed by the request's salt, as the target's is. Returns
        no drafts on a failure (logged), never raises an Exception."""
        start = time.perf_counter()
        drafts: dict[tuple[str, int], list[int]] = {}
        names: dict[str, tuple[str, int]] = {}
        try:
            for request_id, index, tokens, salt in samples:
                room = min(k, self.k, self.max_model_len - len(tokens))
                if room < 1:
                    continue
                name = f"{request_id}\x00{index}"
                names[name] = (request_id, index)
                self.scheduler.add_request(name, tokens, max_tokens=room, ignore_eos=True, cache_salt=salt)
            while self.scheduler.has_unfinished_requests():
                out = self.scheduler.schedule()
                if out.num_tokens == 0:
                    self.scheduler.update(out, [])
                    continue
                try:
                    tokens_out = self.runner.execute(out).argmax(dim=-1).tolist()
                except BaseException:
                    self.scheduler.rollback_step(out)
                    raise
                self.num_steps += 1
                for u in self.scheduler.update(out, tokens_out):
                    drafts.setdefault(names[u.request_id], []).extend(u.new_token_ids)
        except Exception as exc:  # the target's step goes on without (some) drafts
            logger.warning("draft model failed, this step gets no drafts: %s: %s", type(exc).__name__, exc)
            self._drop(names)
            drafts = {}
        except BaseException:
            self._drop(names)
            raise
        finally:
            self.seconds += time.perf_counter() - start
        return drafts

    def _drop(self, names: dict[str, Any]) -> None:
        for name in names:
            try:
                self.scheduler.abort_request(name)
            except LookupError:
                pass  # finished already
