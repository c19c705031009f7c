"""How large a request's sampling structures may be: one place for the bounds, each with why.

Every structure a client sizes and the engine pays for at every step (stop strings, stop token
ids, bad words, allowed token ids, logit bias) is bounded here. :class:`SamplingParams` refuses
a larger one with a :class:`~pagedkv.errors.ConfigError` naming the field, before it looks at a
single entry (so a list of millions costs nothing to refuse); ``pagedkv serve`` checks the same
bounds in the handler, before any work, and answers 400 with ``param`` set to the field. The
engine then checks what needs the model: token ids inside the vocabulary, ``allowed_token_ids``
and ``logit_bias`` no longer than it (``pagedkv.sample.prepared``).

The values are far above what clients send (OpenAI allows 4 stop sequences; lm-eval,
LangChain and LiteLLM send a handful; vLLM's own examples a few bad words) and low enough that
what a request costs per step stays a small multiple of what an ordinary one costs.
"""

from __future__ import annotations

__all__ = [
    "MAX_BAD_WORDS",
    "MAX_BAD_WORDS_CHARS",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKEN_ID_ENTRIES",
    "check_count",
]

# `stop`: strings per request. Each one is searched for in every sample's new text at every
# step (a `str.find` over its length plus the new characters).
MAX_STOP_STRINGS = 256
# `stop`: characters of all the stop strings together (what that search reads per step). The
# longest one is also held back from a stream until it cannot be the start of a match.
MAX_STOP_CHARS = 16_384
# `stop_token_ids`: ids per request (compared with every sampled token; banned below
# `min_tokens`).
MAX_STOP_TOKEN_IDS = 1024
# `bad_words`: words per request. Each is tokenized twice when the request is added (as written
# and after a space) and compared with every sample's output tail at every step.
MAX_BAD_WORDS = 256
# `bad_words`: characters of all the words together (what tokenizing them reads).
MAX_BAD_WORDS_CHARS = 16_384
# `allowed_token_ids` and `logit_bias`: entries before the vocabulary is known. The engine
# bounds both by its vocabulary size (a list of distinct ids cannot be longer); this bound only
# stops a list of millions before any entry is read. No vocabulary has 2**20 tokens.
MAX_TOKEN_ID_ENTRIES = 1 << 20


def check_count(name: str, count: int, limit: int, what: str = "entries") -> str | None:
    """The message refusing ``count`` ``what`` of ``name`` when it passes ``limit``, else None
    (the same words for the engine's ConfigError and the server's 400)."""
    if count > limit:
        return f"{name} has {count} {what}, more than the limit of {limit}"
    return None
