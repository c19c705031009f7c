"""Incremental detokenization of one completion, and stop strings.

Decoding token by token and concatenating is wrong for byte-level BPE (one emoji is several
tokens, each of which alone decodes to U+FFFD) and for SentencePiece (a token's leading space
depends on its neighbour). The classic fix (TGI, vLLM) keeps two offsets into the token list:

* ``prefix_offset``: start of a short window of already-emitted tokens kept as context;
* ``read_offset``: end of the tokens whose text has been emitted.

Each update decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``; the new text
is the second minus the first. It is emitted only when it is *stable*: longer than the context
text and not ending in U+FFFD (an incomplete UTF-8 sequence that the next token completes).
Then both offsets advance. Decoding a window of a few tokens per step keeps the cost per token
constant, whatever the length of the completion.

The window starts on the last few prompt tokens (when given), so the first generated token is
decoded in context, as vLLM does.

Stop strings are searched only in the tail that can contain a new match (the new characters
plus ``len(stop) - 1`` before them). A match truncates the text before the stop string, or after
it with ``include_stop_str_in_output``. While the completion runs, :meth:`visible_text` (the
cumulative text a stream shows) and :meth:`get_delta` hold back the last
``len(longest stop) - 1`` characters, so that a stream never shows the beginning of a stop
string that the next token completes (and that would then be cut): the visible text only ever
grows, and every earlier visible text is a prefix of the final one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.sample.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "make_decode_fn"]

# Prompt tokens used as decoding context for the first generated tokens (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[Sequence[int], bool], str]


def make_decode_fn(tokenizer: Any) -> DecodeFn:
    """``decode(ids, skip_special_tokens) -> str`` for ``tokenizer``, as cheap as possible.

    For tokenizers backed by the Rust ``tokenizers`` library (all "fast" tokenizers) the Rust
    decoder is called directly, without the Python wrapper's overhead. It differs
    from ``tokenizer.decode`` only by ``clean_up_tokenization_spaces``, so the wrapper is kept
    for tokenizers that enable that cleanup.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is not None
        and hasattr(backend, "decode")
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):

        def decode_backend(ids: Sequence[int], skip_special_tokens: bool) -> str:
            return str(backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

        return decode_backend

    def decode_python(ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    return decode_python


class IncrementalDetokenizer:
    """The text of one completion, built token by token, with stop-string detection.

    ``update(new_token_ids)`` per step, then ``get_delta()`` for the text to stream. After a
    stop string matched, ``stop_reason`` holds it and further updates are refused.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        decode_fn: DecodeFn | None = None,
    ) -> None:
        self._decode = decode_fn or make_decode_fn(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        # Longest stop string minus one: the most characters a partial match can occupy.
        self._stop_buffer = max(len(s) for s in self.stop) - 1 if self.stop and not include_stop_str_in_output else 0

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        # Context tokens then the decoded generated tokens; offsets index into this list.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

        self.token_ids: list[int] = []  # every generated token, including unprinted ones
        self.output_text = ""
        self.stop_reason: str | None = None
        # Characters of output_text shown so far (visible_text); never decreases, and never
        # passes a stop string's start (a match ends in new text, after the held-back tail).
        self._shown = 0
        self._emitted = 0  # characters of output_text already returned by get_delta

    @classmethod
    def from_params(
        cls,
        tokenizer: Any,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] | None = None,
        decode_fn: DecodeFn | None = None,
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids=prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            decode_fn=decode_fn,
        )

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append generated tokens; return the stop string that matched, if one did.

        ``stop_terminated``: the last of ``new_token_ids`` ended the completion (eos or a stop
        token id); like vLLM, its text is then left out unless ``include_stop_str_in_output``.
        """
        if self.stop_reason is not None:
            raise RuntimeError("update() after a stop string matched: the completion is finished")
        self.token_ids.extend(new_token_ids)
        to_decode = list(new_token_ids)
        if stop_terminated and to_decode and not self.include_stop_str_in_output:
            to_decode.pop()
        if not to_decode:
            return None

        text_before = len(self.output_text)
        self._ids.extend(to_decode)
        self.output_text += self._decode_new_text()

        if not self.stop or len(self.token_ids) < self.min_tokens:
            return None
        return self._check_stop_strings(len(self.output_text) - text_before)

    def visible_text(self, finished: bool = False) -> str:
        """The cumulative text to show now: all of it once ``finished`` (or after a stop string
        matched); while running, without a tail that may be the start of a stop string."""
        if finished or self.stop_reason is not None:
            self._shown = len(self.output_text)
        else:
            self._shown = max(self._shown, len(self.output_text) - self._stop_buffer)
        return self.output_text[: self._shown]

    def get_delta(self, finished: bool = False) -> str:
        """Text not returned yet (the growth of :meth:`visible_text` since the last call)."""
        text = self.visible_text(finished)
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def _decode_new_text(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full_text = self._decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            # Incomplete character (or a skipped special token): wait for more tokens.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        """Find the earliest stop string ending in the new text; truncate there."""
        if new_char_count == 0:
            return None
        best_index = -1
        best_stop = None
        text_len = len(self.output_text)
        for stop in self.stop:
            # A new match must end inside the new characters.
            start = max(0, text_len - new_char_count - len(stop) + 1)
            index = self.output_text.find(stop, start)
            if index != -1 and (best_index == -1 or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        cut = best_index + len(best_stop) if self.include_stop_str_in_output else best_index
        self.output_text = self.output_text[:cut]
        self.stop_reason = best_stop
        return best_stop
