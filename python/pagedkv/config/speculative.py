"""Speculative decoding's configuration (:class:`SpeculativeConfig`, vLLM's
``speculative_config`` names). The proposers, their defaults and their ranges are the Rust
core's (rust/scheduler/config.rs): the core resolves and checks a config
(``pagedkv._core.resolve_speculative``); Python checks only the draft model, which the core
does not load."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedkv import _core
from pagedkv.config.fields import CORE_FIELDS, config_from_any, core_message, core_setting, documented, setting
from pagedkv.errors import ConfigError

__all__ = ["MAX_SPECULATIVE_TOKENS", "SPECULATIVE_METHODS", "SpeculativeConfig"]

SPECULATIVE_METHODS: tuple[str, ...] = tuple(CORE_FIELDS["speculative_method"]["choices"])
MAX_SPECULATIVE_TOKENS: int = CORE_FIELDS["num_speculative_tokens"]["max"]

_NAME = "speculative_config"
_METHOD_DEFAULT = "the method's default; ``None`` when another method is chosen"


@documented
@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/engine.md, "Speculative decoding"). Parameters left
    ``None`` take the core's defaults for the chosen method (set on the built config)."""

    num_speculative_tokens: int | None = core_setting(
        "num_speculative_tokens",
        f"most tokens drafted per sequence and step, 1 .. {MAX_SPECULATIVE_TOKENS} (required).",
    )
    method: str = core_setting(
        "speculative_method",
        '``"ngram"`` (prompt lookup over the request\'s prompt and output) or ``"suffix"`` (suffix decoding: '
        "the longest suffix matched in the request's tokens and in recent requests' outputs, a variable number "
        'of drafts by continuation frequency), both in the Rust core; or ``"draft_model"``: a smaller model '
        "(``model``: its id or folder) with the target's vocabulary, on its own paged KV "
        "(:mod:`pagedkv.engine.draft_model`).",
    )
    prompt_lookup_min: int | None = core_setting(
        "prompt_lookup_min",
        f"``ngram``: the shortest suffix of the sequence looked up ({_METHOD_DEFAULT}; with only "
        "``prompt_lookup_max`` given, at most it).",
        default=None,
    )
    prompt_lookup_max: int | None = core_setting(
        "prompt_lookup_max",
        f"``ngram``: the longest suffix looked up ({_METHOD_DEFAULT}; with only ``prompt_lookup_min`` given, "
        "at least it).",
        default=None,
    )
    adaptive: bool = core_setting(
        "speculative_adaptive",
        "let the step-time model draft fewer tokens, down to none, where drafts would not pay (large "
        "batches); off: always draft what the proposer finds.",
    )
    suffix_decoding_max_tree_depth: int | None = core_setting(
        "suffix_decoding_max_tree_depth", f"``suffix``: the longest suffix matched ({_METHOD_DEFAULT}).", default=None
    )
    suffix_decoding_max_spec_factor: float | None = core_setting(
        "suffix_decoding_max_spec_factor",
        f"``suffix``: drafts at most this times the match length ({_METHOD_DEFAULT}).",
        default=None,
    )
    suffix_decoding_min_token_prob: float | None = core_setting(
        "suffix_decoding_min_token_prob",
        f"``suffix``: stop drafting when the draft's estimated probability falls below ({_METHOD_DEFAULT}).",
        default=None,
    )
    suffix_decoding_max_cached_requests: int | None = core_setting(
        "suffix_decoding_max_cached_requests",
        f"``suffix``: recent outputs matched against; 0: the request's own tokens only ({_METHOD_DEFAULT}).",
        default=None,
    )
    model: str | None = setting(None, "``draft_model``: the draft model's id or folder.")

    def __post_init__(self) -> None:
        given = {f.metadata["core"]: getattr(self, f.name) for f in dataclasses.fields(self) if "core" in f.metadata}
        try:
            resolved = _core.resolve_speculative(**given)
        except ConfigError as exc:
            names = {core: name for core, name in _CORE_NAMES.items() if core != name}
            raise ConfigError(f"{_NAME}: {core_message(exc, names)}") from None
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError(
                f"{_NAME}: method 'draft_model' needs model (the draft model's id or folder)"
                if self.model is None
                else f"{_NAME}: model applies to method 'draft_model', not {self.method!r}"
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"{_NAME}: model must be a model id or folder, got {self.model!r}")
        for core, name in _CORE_NAMES.items():
            if core in resolved:
                object.__setattr__(self, name, resolved[core])

    @classmethod
    def from_any(cls, value: Any) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict of its fields, its JSON text (the CLI flag), or None
        (speculative decoding off)."""
        return None if value is None else config_from_any(cls, value, _NAME)


# The core's keyword of each field that is a core setting -> the field's name.
_CORE_NAMES = {f.metadata["core"]: f.name for f in dataclasses.fields(SpeculativeConfig) if "core" in f.metadata}
