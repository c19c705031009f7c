"""Turn ShareGPT conversations into tokenized trace requests.

Two workloads:

* **first turns** (what vLLM's serving benchmark replays): prompt = the first human message,
  output length = the token count of the gpt reply that follows. Pairs are kept by vLLM's rule:
  drop when prompt or output has fewer than ``min_len`` tokens, when the prompt is longer than
  ``max_prompt_len``, or when prompt + output exceeds ``max_model_len``. One difference: vLLM
  takes a record's first two messages whatever their speakers; here they must be human then gpt
  (about a third of ShareGPT V3 records are continuation fragments that start with gpt).
* **multi-turn**: every human message of a conversation is one request whose prompt is the whole
  conversation so far (earlier messages and replies), so turn ``k + 1``'s prompt starts with turn
  ``k``'s prompt token for token: what a chat client resends, and what prefix caching reuses.

Requests carry ``arrival_time = 0`` unless arrivals are given; see
:func:`pagedkv.sim.workloads.arrivals.assign_arrivals`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.sim.workloads.arrivals import ArrivalProcess
from pagedkv.sim.workloads.request import TraceRequest
from pagedkv.sim.workloads.sharegpt import Conversation, load_sharegpt_conversations
from pagedkv.sim.workloads.tokenization import default_tokenizer, encode_batch, has_chat_template

__all__ = ["sharegpt_first_turn_requests", "sharegpt_multi_turn_requests", "chat_turn_texts"]

_TEMPLATE_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def _ordered_indices(count: int, shuffle_seed: int | None) -> np.ndarray:
    if shuffle_seed is None:
        return np.arange(count)
    return np.random.default_rng(shuffle_seed).permutation(count)


def _batches(indices: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(indices), size):
        yield indices[start : start + size]


def _check_common(max_model_len: int, batch_size: int, limit: int | None, limit_name: str) -> None:
    if max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if limit is not None and limit < 0:
        raise ConfigError(f"{limit_name} must be >= 0 or None, got {limit}")


def sharegpt_first_turn_requests(
    num_requests: int | None = None,
    *,
    tokenizer: Any | None = None,
    max_model_len: int = 2048,
    max_prompt_len: int | None = 1024,
    min_len: int = 4,
    chat_template: bool = False,
    shuffle_seed: int | None = None,
    conversations: Sequence[Conversation] | None = None,
    batch_size: int = 1024,
) -> list[TraceRequest]:
    """First-turn (prompt, reply length) pairs of ShareGPT as requests, vLLM benchmark style.

    Args:
        num_requests: stop after this many kept pairs (None: all of them, ~9.4k with defaults).
        tokenizer: any Hugging Face tokenizer; default :func:`default_tokenizer` (SmolLM2).
        max_model_len: drop pairs whose prompt + output tokens exceed it.
        max_prompt_len: drop pairs whose prompt exceeds it (None: no separate prompt cap).
        min_len: drop pairs whose prompt or output has fewer tokens.
        chat_template: render the prompt as a one-message chat with the tokenizer's template
            (adds the template's tokens); default False, the raw message as vLLM does.
        shuffle_seed: visit conversations in a seeded random order (None: file order).
        conversations: the conversations to use (default: all of ShareGPT V3).
        batch_size: conversations tokenized per batch (only the needed batches are tokenized).

    Request ids are ``"sharegpt-<index of the conversation>"``; arrival times are 0.
    """
    _check_common(max_model_len, batch_size, num_requests, "num_requests")
    if min_len < 1:
        raise ConfigError(f"min_len must be >= 1, got {min_len}")
    if chat_template and tokenizer is not None and not has_chat_template(tokenizer):
        raise ConfigError("chat_template=True but the tokenizer has no chat template")
    tokenizer = default_tokenizer() if tokenizer is None else tokenizer
    if conversations is None:
        conversations = load_sharegpt_conversations()
    candidates = [
        index
        for index in _ordered_indices(len(conversations), shuffle_seed)
        if len(conversations[index].turns) >= 2
        and conversations[index].turns[0].role == "human"
        and conversations[index].turns[1].role == "gpt"
    ]
    requests: list[TraceRequest] = []
    for batch in _batches(np.asarray(candidates, dtype=np.int64), batch_size):
        if num_requests is not None and len(requests) >= num_requests:
            break
        prompts = [conversations[index].turns[0].text for index in batch]
        if chat_template:
            prompts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    add_generation_prompt=True,
                    tokenize=False,
                )
                for prompt in prompts
            ]
        prompt_ids = encode_batch(tokenizer, prompts)
        output_ids = encode_batch(tokenizer, [conversations[index].turns[1].text for index in batch])
        for index, prompt, output in zip(batch, prompt_ids, output_ids):
            prompt_len, output_len = len(prompt), len(output)
            if prompt_len < min_len or output_len < min_len:
                continue
            if max_prompt_len is not None and prompt_len > max_prompt_len:
                continue
            if prompt_len + output_len > max_model_len:
                continue
            requests.append(TraceRequest(f"sharegpt-{index}", 0.0, prompt, output_len))
            if num_requests is not None and len(requests) == num_requests:
                break
    return requests


def _dialogue(conversation: Conversation) -> tuple[str | None, list[tuple[str, str]]]:
    """(system text, [(human, gpt), ...]) of the leading regular part of a conversation.

    Leading system turns are joined into one system message; then human and gpt must alternate
    starting with human. The dialogue stops at the first turn that breaks the alternation.
    """
    turns = list(conversation.turns)
    system_parts = []
    while turns and turns[0].role == "system":
        system_parts.append(turns.pop(0).text)
    pairs = []
    for position in range(0, len(turns) - 1, 2):
        human, gpt = turns[position], turns[position + 1]
        if human.role != "human" or gpt.role != "gpt":
            break
        pairs.append((human.text, gpt.text))
    return ("\n".join(system_parts) if system_parts else None), pairs


def chat_turn_texts(
    tokenizer: Any, system: str | None, pairs: Sequence[tuple[str, str]], *, use_template: bool
) -> list[str]:
    """The full prompt text of each turn: earlier messages and replies, then the k-th message.

    With ``use_template`` it is the tokenizer's chat template with a generation prompt; without,
    messages are joined by newlines (system text first when there is one).
    """
    texts = []
    if use_template:
        messages: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system}]
        for human, gpt in pairs:
            messages.append({"role": "user", "content": human})
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
            messages.append({"role": "assistant", "content": gpt})
        return texts
    history = "" if system is None else system + "\n"
    for human, gpt in pairs:
        history += human + "\n"
        texts.append(history)
        history += gpt + "\n"
    return texts


def _tokenize_turns(tokenizer: Any, turn_texts: list[list[str]]) -> list[list[np.ndarray]]:
    """Token ids of every turn prompt of several conversations, prefix-consistent.

    When a turn's text extends the previous turn's text (true for ordinary chat templates and
    for plain concatenation), only the new piece is tokenized and appended, so turn k+1's ids
    start exactly with turn k's. Otherwise the turn is tokenized whole.
    """
    pieces: list[str] = []
    for texts in turn_texts:
        previous = ""
        for text in texts:
            pieces.append(text[len(previous) :] if text.startswith(previous) else text)
            previous = text
    piece_ids = iter(encode_batch(tokenizer, pieces))
    result = []
    for texts in turn_texts:
        previous_text, previous_ids = "", np.zeros(0, dtype=np.int32)
        conversation_ids = []
        for text in texts:
            ids = next(piece_ids)
            if text.startswith(previous_text):
                ids = np.concatenate([previous_ids, ids])
            conversation_ids.append(ids)
            previous_text, previous_ids = text, ids
        result.append(conversation_ids)
    return result


def _common_prefix_len(first: np.ndarray, second: np.ndarray) -> int:
    """How many leading tokens two int32 arrays share."""
    length = min(len(first), len(second))
    differs = np.flatnonzero(first[:length] != second[:length])
    return int(differs[0]) if differs.size else length


def sharegpt_multi_turn_requests(
    num_conversations: int | None = None,
    *,
    tokenizer: Any | None = None,
    max_model_len: int = 2048,
    max_turns: int | None = None,
    chat_template: bool | None = None,
    arrivals: ArrivalProcess | None = None,
    turn_interval_s: float = 0.0,
    arrival_seed: int = 0,
    shuffle_seed: int | None = None,
    conversations: Sequence[Conversation] | None = None,
    batch_size: int = 256,
) -> list[TraceRequest]:
    """Multi-turn ShareGPT conversations as requests, one per human message, for prefix studies.

    Turn ``k`` of a conversation has request id ``"sharegpt-<index>-turn<k>"``; its prompt is the
    conversation up to and including the k-th human message, its ``output_len`` the token count
    of the k-th gpt reply. Turns ``k >= 1`` declare ``shared_prefix_id = "sharegpt-<index>"`` and
    ``shared_prefix_len`` = the tokens shared with the previous turn's prompt, which is all of
    that prompt for ordinary templates (the part a prefix cache holds from that turn; a replay
    generates its own tokens in place of the recorded reply, so the reply's KV is not
    reusable). A conversation ends at its first turn with an empty reply, with prompt
    + output over ``max_model_len``, or after ``max_turns``; conversations left with no turn are
    skipped and do not count toward ``num_conversations``.

    Args:
        chat_template: use the tokenizer's chat template (None: when it has one); else plain
            newline-joined text.
        arrivals: when each conversation starts (default: all at t = 0), drawn with
            ``arrival_seed``; turn k arrives ``k * turn_interval_s`` seconds after its start.
            The result is sorted by arrival time (ties keep conversation and turn order).
        shuffle_seed: visit conversations in a seeded random order (None: file order).
    """
    _check_common(max_model_len, batch_size, num_conversations, "num_conversations")
    if max_turns is not None and max_turns < 1:
        raise ConfigError(f"max_turns must be >= 1 or None, got {max_turns}")
    if not turn_interval_s >= 0:
        raise ConfigError(f"turn_interval_s must be >= 0, got {turn_interval_s}")
    tokenizer = default_tokenizer() if tokenizer is None else tokenizer
    if chat_template is None:
        chat_template = has_chat_template(tokenizer)
    elif chat_template and not has_chat_template(tokenizer):
        raise ConfigError("chat_template=True but the tokenizer has no chat template")
    if conversations is None:
        conversations = load_sharegpt_conversations()

    dialogues: list[tuple[int, list[tuple[np.ndarray, int]]]] = []  # (index, [(prompt, out_len)])
    for batch in _batches(_ordered_indices(len(conversations), shuffle_seed), batch_size):
        if num_conversations is not None and len(dialogues) >= num_conversations:
            break
        parsed = [(int(index), *_dialogue(conversations[index])) for index in batch]
        parsed = [(index, system, pairs[:max_turns]) for index, system, pairs in parsed if pairs]
        texts = [chat_turn_texts(tokenizer, system, pairs, use_template=chat_template) for _, system, pairs in parsed]
        prompt_ids = _tokenize_turns(tokenizer, texts)
        reply_ids = iter(encode_batch(tokenizer, [gpt for _, _, pairs in parsed for _, gpt in pairs]))
        for (index, _, pairs), prompts in zip(parsed, prompt_ids):
            replies = [len(next(reply_ids)) for _ in pairs]
            turns = []
            for prompt, output_len in zip(prompts, replies):
                if output_len < 1 or len(prompt) + output_len > max_model_len:
                    break
                turns.append((prompt, output_len))
            if turns and (num_conversations is None or len(dialogues) < num_conversations):
                dialogues.append((index, turns))

    starts = (arrivals or ArrivalProcess()).sample(len(dialogues), np.random.default_rng(arrival_seed))
    requests = []
    for (index, turns), start in zip(dialogues, starts):
        previous_prompt = np.zeros(0, dtype=np.int32)
        for turn, (prompt, output_len) in enumerate(turns):
            shared = _common_prefix_len(previous_prompt, prompt)
            requests.append(
                TraceRequest(
                    request_id=f"sharegpt-{index}-turn{turn}",
                    arrival_time=float(start) + turn * turn_interval_s,
                    prompt_token_ids=prompt,
                    output_len=output_len,
                    shared_prefix_id=f"sharegpt-{index}" if shared else None,
                    shared_prefix_len=shared,
                )
            )
            previous_prompt = prompt
    requests.sort(key=lambda request: request.arrival_time)  # stable: ties keep their order
    return requests
