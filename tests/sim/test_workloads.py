"""Workloads: the request type, the JSONL trace format, synthesis, arrivals and ShareGPT."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from pagedkv.errors import ConfigError, InvalidArgumentError, TraceFormatError
from pagedkv.sim.workloads import (
    ArrivalProcess,
    Conversation,
    TraceRequest,
    Turn,
    assign_arrivals,
    default_tokenizer,
    encode_batch,
    iter_json_array,
    load_sharegpt_conversations,
    load_trace,
    parse_sharegpt_records,
    parse_trace_lines,
    prefix_tokens,
    save_trace,
    shared_prefix_requests,
    sharegpt_first_turn_requests,
    sharegpt_multi_turn_requests,
    unique_tokens,
    zipf_weights,
)

# --------------------------------------------------------------------------- TraceRequest


def test_trace_request_normalizes_prompt_to_read_only_int32() -> None:
    request = TraceRequest("a", 0, [5, 6, 7], 3)
    assert request.prompt_token_ids.dtype == np.int32
    assert request.prompt_len == 3
    assert request.arrival_time == 0.0 and isinstance(request.arrival_time, float)
    with pytest.raises(ValueError):
        request.prompt_token_ids[0] = 1
    assert request == TraceRequest("a", 0.0, np.array([5, 6, 7], dtype=np.int64), 3)
    assert request != TraceRequest("a", 0.0, [5, 6, 8], 3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"arrival_time": -1.0}, "arrival_time"),
        ({"arrival_time": math.nan}, "arrival_time"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [2**31]}, "prompt_token_ids[0]"),
        ({"prompt_token_ids": np.zeros((2, 2), dtype=np.int32)}, "prompt_token_ids"),
        ({"output_len": 0}, "output_len"),
        ({"n": 0}, "n"),
        ({"shared_prefix_len": 2}, "shared_prefix_len"),
        ({"shared_prefix_id": "p"}, "shared_prefix_id"),
        ({"shared_prefix_id": "p", "shared_prefix_len": 4}, "shared_prefix_len"),
    ],
)
def test_trace_request_rejects_bad_fields_naming_them(kwargs: dict, field: str) -> None:
    fields = {
        "request_id": "r",
        "arrival_time": 0.0,
        "prompt_token_ids": [1, 2, 3],
        "output_len": 2,
    }
    fields.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=f"field '{re.escape(field)}'"):
        TraceRequest(**fields)


# --------------------------------------------------------------------------- trace format

GOOD = '{"arrival_time": 0.0, "prompt_token_ids": [1, 2, 3], "output_len": 4}'


@pytest.mark.parametrize(
    ("bad_line", "field"),
    [
        ('{"arrival_time": 1.0, "prompt_token_ids": [1, 2], "output_len": 4', None),  # malformed
        ("[1, 2, 3]", None),  # not an object
        ('{"arrival_time": 1.0, "prompt_token_ids": [1]}', "output_len"),
        ('{"prompt_token_ids": [1], "output_len": 2}', "arrival_time"),
        ('{"arrival_time": 1.0, "output_len": 2}', "prompt_token_ids"),
        ('{"arrival_time": 1.0, "prompt_token_ids": [1], "output_len": 0}', "output_len"),
        ('{"arrival_time": 1.0, "prompt_token_ids": [1], "output_len": -3}', "output_len"),
        ('{"arrival_time": 1.0, "prompt_token_ids": [1], "output_len": 2.5}', "output_len"),
        ('{"arrival_time": 1.0, "prompt_token_ids": [1], "output_len": true}', "output_len"),
        ('{"arrival_time": 1.0, "prompt_len": 0, "output_len": 2}', "prompt_len"),
        ('{"arrival_time": 1.0, "prompt_token_ids": [], "output_len": 2}', "prompt_token_ids"),
        (
            '{"arrival_time": 1.0, "prompt_token_ids": [1, -5], "output_len": 2}',
            "prompt_token_ids[1]",
        ),
        (
            '{"arrival_time": 1.0, "prompt_token_ids": [1, 2.0], "output_len": 2}',
            "prompt_token_ids[1]",
        ),
        (
            '{"arrival_time": 1.0, "prompt_token_ids": ["a"], "output_len": 2}',
            "prompt_token_ids[0]",
        ),
        ('{"arrival_time": 1.0, "prompt_token_ids": "123", "output_len": 2}', "prompt_token_ids"),
        (
            '{"arrival_time": 1.0, "prompt_token_ids": [2147483648], "output_len": 2}',
            "prompt_token_ids[0]",
        ),
        ('{"arrival_time": NaN, "prompt_token_ids": [1], "output_len": 2}', "arrival_time"),
        ('{"arrival_time": Infinity, "prompt_token_ids": [1], "output_len": 2}', "arrival_time"),
        ('{"arrival_time": "1", "prompt_token_ids": [1], "output_len": 2}', "arrival_time"),
        ('{"arrival_time": -0.5, "prompt_token_ids": [1], "output_len": 2}', "arrival_time"),
        ('{"arrival_time": 1.0, "prompt_token_ids": [1], "output_len": 2, "n": 0}', "n"),
        (
            '{"arrival_time": 1.0, "prompt_token_ids": [1], "output_len": 2, "ouput_len": 2}',
            "ouput_len",
        ),
        (
            '{"arrival_time": 1.0, "prompt_token_ids": [1, 2], "prompt_len": 3, "output_len": 2}',
            "prompt_len",
        ),
        (
            '{"arrival_time": 1.0, "prompt_len": 8, "shared_prefix_len": 4, "output_len": 2}',
            "shared_prefix_len",
        ),
        (
            '{"arrival_time": 1.0, "prompt_len": 8, "shared_prefix_id": "s", "output_len": 2}',
            "shared_prefix_id",
        ),
        (
            '{"arrival_time": 1.0, "prompt_len": 8, "shared_prefix_id": "s", "shared_prefix_len": 9, "output_len": 2}',
            "shared_prefix_len",
        ),
        (
            '{"arrival_time": 1.0, "prompt_len": 8, "shared_prefix_id": [1], "shared_prefix_len": 2, "output_len": 2}',
            "shared_prefix_id",
        ),
        ('{"arrival_time": 1.0, "prompt_len": 8, "output_len": 2, "request_id": ""}', "request_id"),
    ],
)
def test_loader_error_names_line_and_field(bad_line: str, field: str | None) -> None:
    # Line 2 is blank: line numbers count it, so the bad line is line 3.
    lines = [GOOD, "", bad_line, GOOD.replace("0.0", "5.0")]
    with pytest.raises(TraceFormatError) as caught:
        parse_trace_lines(lines, source="t.jsonl")
    message = str(caught.value)
    if field is None:
        assert message.startswith("t.jsonl:3: ")
    else:
        assert message.startswith(f"t.jsonl:3: field '{field}'"), message


def test_loader_rejects_decreasing_arrival_and_duplicate_ids() -> None:
    later = '{"arrival_time": 2.0, "prompt_token_ids": [1], "output_len": 2}'
    earlier = '{"arrival_time": 1.5, "prompt_token_ids": [1], "output_len": 2}'
    with pytest.raises(TraceFormatError, match=r"^<trace>:2: field 'arrival_time': 1.5 is earlier"):
        parse_trace_lines([later, earlier])
    # Equal times are fine (non-decreasing).
    assert len(parse_trace_lines([later, later])) == 2
    first = '{"arrival_time": 0, "prompt_len": 3, "output_len": 2, "request_id": "x"}'
    with pytest.raises(TraceFormatError, match=r"^<trace>:3: field 'request_id': 'x' was already used on line 1"):
        parse_trace_lines([first, GOOD, first])
    # An integer id means its decimal string: it clashes with the default id of position 0.
    with pytest.raises(TraceFormatError, match=r"^<trace>:2: field 'request_id'"):
        parse_trace_lines([GOOD, GOOD.replace("}", ', "request_id": 0}')])


def test_load_trace_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n" + '{"arrival_time": 1}\n', encoding="utf-8")
    with pytest.raises(TraceFormatError, match=f"^{path}:2: field 'output_len': is missing"):
        load_trace(path)


def test_save_load_round_trip(tmp_path: Path) -> None:
    requests = [
        TraceRequest("first", 0.0, [3, 1, 4, 1, 5], 7),
        TraceRequest("second", 0.1 + 0.2, np.arange(40, dtype=np.int32), 1, n=3),
        TraceRequest("third", 2.5, [9, 9, 9, 2], 12, shared_prefix_id="sys", shared_prefix_len=3),
    ]
    path = tmp_path / "trace.jsonl"
    save_trace(path, requests)
    assert load_trace(path) == requests
    assert len(path.read_text().splitlines()) == 3


def test_save_trace_refuses_what_the_loader_would_reject(tmp_path: Path) -> None:
    out_of_order = [TraceRequest("a", 1.0, [1], 1), TraceRequest("b", 0.5, [1], 1)]
    with pytest.raises(TraceFormatError, match="arrival_time"):
        save_trace(tmp_path / "x.jsonl", out_of_order)
    duplicated = [TraceRequest("a", 0.0, [1], 1), TraceRequest("a", 0.5, [1], 1)]
    with pytest.raises(TraceFormatError, match="request_id"):
        save_trace(tmp_path / "y.jsonl", duplicated)
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "y.jsonl").exists()


def test_length_only_lines_synthesize_deterministic_shared_prefixes(tmp_path: Path) -> None:
    lines = [
        '{"arrival_time": 0, "prompt_len": 3000, "shared_prefix_id": "sys", "shared_prefix_len": 2500, "output_len": 4}',
        '{"arrival_time": 0, "prompt_len": 100, "shared_prefix_id": "sys", "shared_prefix_len": 60, "output_len": 4}',
        '{"arrival_time": 1, "prompt_len": 2600, "shared_prefix_id": "sys", "shared_prefix_len": 2500, "output_len": 4}',
        '{"arrival_time": 1, "prompt_len": 50, "shared_prefix_id": 7, "shared_prefix_len": 50, "output_len": 4}',
        '{"arrival_time": 2, "prompt_len": 80, "output_len": 4}',
    ]
    a, b, c, d, e = parse_trace_lines(lines, vocab_size=1000, seed=3)
    assert [r.request_id for r in (a, b, c, d, e)] == ["0", "1", "2", "3", "4"]
    assert d.shared_prefix_id == "7"
    # The same prefix id gives the same leading tokens, whatever length each line asks for.
    assert np.array_equal(a.prompt_token_ids[:2500], c.prompt_token_ids[:2500])
    assert np.array_equal(a.prompt_token_ids[:60], b.prompt_token_ids[:60])
    # Private parts differ from each other (same length, different request ids).
    assert not np.array_equal(a.prompt_token_ids[2500:2600], c.prompt_token_ids[2500:])
    for request in (a, b, c, d, e):
        assert request.prompt_token_ids.min() >= 0 and request.prompt_token_ids.max() < 1000
    # Deterministic for the same seed, different for another.
    assert parse_trace_lines(lines, vocab_size=1000, seed=3) == [a, b, c, d, e]
    assert parse_trace_lines(lines, vocab_size=1000, seed=4)[0] != a
    # The loader and the synthesis functions agree, so traces and generators can mix.
    assert np.array_equal(a.prompt_token_ids[:2500], prefix_tokens("sys", 2500, vocab_size=1000, seed=3))
    assert np.array_equal(e.prompt_token_ids, unique_tokens("4", 80, vocab_size=1000, seed=3))
    # Tokens of a saved synthesized trace read back equal.
    path = tmp_path / "synth.jsonl"
    save_trace(path, [a, b, c, d, e])
    assert load_trace(path) == [a, b, c, d, e]


def test_example_trace_file_loads() -> None:
    """tests/data/example_trace.jsonl is the documented example: both line forms and a blank line."""
    requests = load_trace(Path(__file__).parents[1] / "data" / "example_trace.jsonl")
    assert [(r.request_id, r.prompt_len, r.output_len, r.n) for r in requests] == [
        ("chat-1", 8, 32, 1),
        ("sys-a-1", 700, 128, 1),
        ("sys-a-2", 540, 64, 2),
        ("solo", 90, 200, 1),
    ]
    assert [r.arrival_time for r in requests] == [0.0, 0.25, 0.5, 1.75]
    assert np.array_equal(requests[1].prompt_token_ids[:512], requests[2].prompt_token_ids[:512])
    assert requests[1].prompt_token_ids[512] != requests[2].prompt_token_ids[512]


def test_prefix_stream_is_prefix_consistent_across_chunks() -> None:
    long = prefix_tokens("x", 5000)
    for length in (0, 1, 1023, 1024, 1025, 4999):
        assert np.array_equal(prefix_tokens("x", length), long[:length])
    assert not np.array_equal(prefix_tokens("y", 100), long[:100])
    with pytest.raises(InvalidArgumentError):
        prefix_tokens("x", -1)


# --------------------------------------------------------------------------- synthetic workload


def test_zipf_weights_exact() -> None:
    assert np.allclose(zipf_weights(3, 1.0), [6 / 11, 3 / 11, 2 / 11])
    assert np.allclose(zipf_weights(4, 0.0), [0.25] * 4)
    with pytest.raises(ConfigError):
        zipf_weights(0, 1.0)
    with pytest.raises(ConfigError):
        zipf_weights(3, -1.0)


def test_shared_prefix_workload_is_deterministic_and_zipf_ranked() -> None:
    kwargs = dict(num_prefixes=4, prefix_len=[64, 32, 16, 8], user_len=(5, 9), output_len=(1, 20), zipf_s=1.2)
    first = shared_prefix_requests(2000, seed=11, **kwargs)
    assert first == shared_prefix_requests(2000, seed=11, **kwargs)
    assert first != shared_prefix_requests(2000, seed=12, **kwargs)
    counts = np.bincount([int(r.shared_prefix_id.split("-")[1]) for r in first], minlength=4)
    assert list(counts) == sorted(counts, reverse=True) and counts[0] > 2 * counts[2]
    lengths = {"system-0": 64, "system-1": 32, "system-2": 16, "system-3": 8}
    by_prefix: dict[str, np.ndarray] = {}
    for request in first:
        prefix_len = lengths[request.shared_prefix_id]
        assert request.shared_prefix_len == prefix_len
        assert 5 <= request.prompt_len - prefix_len <= 9 and 1 <= request.output_len <= 20
        head = request.prompt_token_ids[:prefix_len]
        assert np.array_equal(by_prefix.setdefault(request.shared_prefix_id, head), head)
        assert request.arrival_time == 0.0
    # Different system prompts do not start alike.
    assert by_prefix["system-0"][0:8].tolist() != by_prefix["system-3"].tolist()


def test_shared_prefix_workload_rejects_bad_lengths() -> None:
    with pytest.raises(ConfigError, match="prefix_len"):
        shared_prefix_requests(3, num_prefixes=2, prefix_len=[4], user_len=1, output_len=1)
    with pytest.raises(ConfigError, match="user_len"):
        shared_prefix_requests(3, num_prefixes=2, prefix_len=4, user_len=(5, 2), output_len=1)
    with pytest.raises(ConfigError, match="output_len"):
        shared_prefix_requests(3, num_prefixes=2, prefix_len=4, user_len=1, output_len=0)


# --------------------------------------------------------------------------- arrivals


def test_arrival_processes() -> None:
    rng = np.random.default_rng(0)
    assert ArrivalProcess.simultaneous().sample(5, rng).tolist() == [0.0] * 5
    times = ArrivalProcess.poisson(4.0).sample(20001, np.random.default_rng(1))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.25) < 0.01 and abs(gaps.std() / gaps.mean() - 1.0) < 0.03
    bursty = np.diff(ArrivalProcess(rate=4.0, cv=3.0).sample(20001, np.random.default_rng(1)))
    assert abs(bursty.mean() - 0.25) < 0.02 and abs(bursty.std() / bursty.mean() - 3.0) < 0.3
    assert np.array_equal(
        ArrivalProcess(2.0, 0.5).sample(10, np.random.default_rng(5)),
        ArrivalProcess(2.0, 0.5).sample(10, np.random.default_rng(5)),
    )
    for bad in (
        dict(rate=0.0),
        dict(rate=-1.0),
        dict(rate=math.nan),
        dict(cv=0.0),
        dict(cv=math.inf),
    ):
        with pytest.raises(ConfigError):
            ArrivalProcess(**bad)


def test_assign_arrivals_keeps_requests_and_order() -> None:
    requests = [TraceRequest(str(i), 0.0, [i + 1], i + 1) for i in range(6)]
    timed = assign_arrivals(requests, ArrivalProcess.poisson(10.0), seed=2)
    assert [r.request_id for r in timed] == [r.request_id for r in requests]
    assert [r.arrival_time for r in timed] == ArrivalProcess.poisson(10.0).sample(6, np.random.default_rng(2)).tolist()
    assert all(np.array_equal(a.prompt_token_ids, b.prompt_token_ids) for a, b in zip(timed, requests))


# --------------------------------------------------------------------------- ShareGPT parsing


def _records(count: int) -> list[dict]:
    return [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"q{i} é ✓"},
                {"from": "gpt", "value": "a" * i},
            ],
        }
        for i in range(count)
    ]


@pytest.mark.parametrize("chunk_chars", [1, 7, 64, 1 << 20])
def test_iter_json_array_stops_at_every_truncation_point(chunk_chars: int) -> None:
    records = _records(5)
    text = json.dumps(records, indent=1, ensure_ascii=False)
    ends = []  # where each element's closing brace ends in the text
    decoder, position = json.JSONDecoder(), text.index("{")
    for _ in records:
        _, position = decoder.raw_decode(text, position)
        ends.append(position)
        position = text.find("{", position)
    for cut in range(len(text) + 1):
        expected = [record for record, end in zip(records, ends) if end <= cut]
        if cut == 0:
            with pytest.raises(TraceFormatError):
                list(iter_json_array(io.StringIO(text[:cut]), chunk_chars=chunk_chars))
            continue
        got = list(iter_json_array(io.StringIO(text[:cut]), chunk_chars=chunk_chars))
        assert got == expected, cut


def test_iter_json_array_reads_bytes_and_handles_edge_shapes() -> None:
    records = _records(3)
    payload = json.dumps(records, ensure_ascii=False).encode("utf-8")
    stream = io.BytesIO(payload)
    assert list(iter_json_array(stream, chunk_chars=3)) == records  # splits multi-byte chars
    assert not stream.closed
    # A tail cut inside a multi-byte character ends the iteration like any other damage.
    assert list(iter_json_array(io.BytesIO(payload[: payload.rindex("✓".encode()) + 1]))) == records[:2]
    # A number cut by a chunk boundary is read whole (numbers, unlike objects, end silently).
    assert list(iter_json_array(io.StringIO("[12345, 678]"), chunk_chars=2)) == [12345, 678]
    assert list(iter_json_array(io.StringIO("  [ ] trailing"))) == []
    assert list(iter_json_array(io.StringIO('[{"a": 1} {"b": 2}]'))) == [{"a": 1}]  # missing comma
    with pytest.raises(TraceFormatError, match="JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_sharegpt_record_parsing_normalizes_roles_and_skips_bad_records() -> None:
    records = [
        {
            "id": "x",
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "user", "value": "q"},
                {"from": "chatgpt", "value": "a"},
            ],
        },
        {"id": "bad-role", "conversations": [{"from": "narrator", "value": "q"}]},
        {"id": "no-list", "conversations": "text"},
        {
            "id": "y",
            "conversations": [{"from": "human", "value": "q2"}, {"from": "bard", "value": "a2"}],
        },
    ]
    text = json.dumps(records)[:-1] + ', {"id": "cut", "conversations": [{"from": "hu'
    got = list(parse_sharegpt_records(io.StringIO(text)))
    assert got == [
        Conversation("x", (Turn("system", "s"), Turn("human", "q"), Turn("gpt", "a"))),
        Conversation("y", (Turn("human", "q2"), Turn("gpt", "a2"))),
    ]
    assert list(parse_sharegpt_records(io.StringIO(text), limit=1)) == got[:1]


def test_load_sharegpt_conversations_reads_the_whole_truncated_file() -> None:
    conversations = load_sharegpt_conversations()
    assert 17_000 <= len(conversations) <= 18_000
    assert conversations[0].conversation_id == "QWJhYvA_0"
    assert {turn.role for c in conversations for turn in c.turns} == {"human", "gpt", "system"}
    assert load_sharegpt_conversations(25) == conversations[:25]
    assert load_sharegpt_conversations()[5] is conversations[5]  # parsed once, cached
    with pytest.raises(InvalidArgumentError):
        load_sharegpt_conversations(-1)


# --------------------------------------------------------------------------- tokenized requests


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(scope="module")
def first_conversations() -> list[Conversation]:
    return load_sharegpt_conversations(300)


def test_encode_batch_matches_the_tokenizer(tokenizer) -> None:
    texts = ["Hello world!", "", "  multiple   spaces\nand lines ✓", "<|im_start|>user"]
    expected = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    got = encode_batch(tokenizer, texts)
    assert [ids.tolist() for ids in got] == expected
    assert all(ids.dtype == np.int32 for ids in got)
    assert encode_batch(tokenizer, []) == []


def test_first_turn_requests_follow_vllm_filtering(tokenizer, first_conversations) -> None:
    requests = sharegpt_first_turn_requests(
        tokenizer=tokenizer,
        conversations=first_conversations,
        max_model_len=600,
        max_prompt_len=300,
        min_len=4,
        batch_size=64,
    )
    expected = []
    for index, conversation in enumerate(first_conversations):
        turns = conversation.turns
        if len(turns) < 2 or turns[0].role != "human" or turns[1].role != "gpt":
            continue
        prompt = tokenizer(turns[0].text, add_special_tokens=False)["input_ids"]
        output = tokenizer(turns[1].text, add_special_tokens=False)["input_ids"]
        if len(prompt) < 4 or len(output) < 4 or len(prompt) > 300 or len(prompt) + len(output) > 600:
            continue
        expected.append((f"sharegpt-{index}", prompt, len(output)))
    assert 20 < len(expected) < 200  # the filters both keep and drop pairs here
    assert [(r.request_id, r.prompt_token_ids.tolist(), r.output_len) for r in requests] == expected
    limited = sharegpt_first_turn_requests(
        7,
        tokenizer=tokenizer,
        conversations=first_conversations,
        max_model_len=600,
        max_prompt_len=300,
    )
    assert limited == requests[:7]
    shuffled = sharegpt_first_turn_requests(7, tokenizer=tokenizer, conversations=first_conversations, shuffle_seed=1)
    assert shuffled == sharegpt_first_turn_requests(
        7, tokenizer=tokenizer, conversations=first_conversations, shuffle_seed=1
    )
    assert [r.request_id for r in shuffled] != [
        r.request_id for r in sharegpt_first_turn_requests(7, tokenizer=tokenizer, conversations=first_conversations)
    ]


def test_first_turn_chat_template_wraps_the_prompt(tokenizer, first_conversations) -> None:
    (plain,) = sharegpt_first_turn_requests(1, tokenizer=tokenizer, conversations=first_conversations)
    (chat,) = sharegpt_first_turn_requests(
        1, tokenizer=tokenizer, conversations=first_conversations, chat_template=True
    )
    assert chat.request_id == plain.request_id and chat.output_len == plain.output_len
    text = tokenizer.decode(chat.prompt_token_ids.tolist())
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert first_conversations[0].turns[0].text in text


def test_multi_turn_prompts_extend_the_previous_turn(tokenizer) -> None:
    conversations = [
        Conversation(
            "a",
            (
                Turn("human", "Hi there"),
                Turn("gpt", "Hello! How can I help?"),
                Turn("human", "Tell me a joke"),
                Turn("gpt", "Why did the chicken cross the road?"),
                Turn("human", "Another"),
                Turn("gpt", ""),
            ),
        ),
        Conversation("b", (Turn("gpt", "orphan reply"), Turn("human", "q"))),  # starts with gpt: skipped
        Conversation(
            "c",
            (
                Turn("system", "Be brief."),
                Turn("human", "2+2?"),
                Turn("gpt", "4"),
                Turn("gpt", "broken alternation"),
            ),
        ),
    ]
    requests = sharegpt_multi_turn_requests(
        tokenizer=tokenizer,
        conversations=conversations,
        arrivals=ArrivalProcess.poisson(1.0),
        turn_interval_s=100.0,
        arrival_seed=3,
    )
    assert [r.request_id for r in requests] == [
        "sharegpt-0-turn0",
        "sharegpt-2-turn0",
        "sharegpt-0-turn1",
    ]
    turn0, other, turn1 = requests
    # Turn 1 resends turn 0's prompt token for token, then the reply and the new message.
    assert np.array_equal(turn1.prompt_token_ids[: turn0.prompt_len], turn0.prompt_token_ids)
    assert (turn1.shared_prefix_id, turn1.shared_prefix_len) == ("sharegpt-0", turn0.prompt_len)
    assert (turn0.shared_prefix_id, turn0.shared_prefix_len) == (None, 0)
    assert tokenizer.decode(turn1.prompt_token_ids.tolist()) == tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert turn0.output_len == len(tokenizer("Hello! How can I help?", add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(other.prompt_token_ids.tolist()).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    starts = ArrivalProcess.poisson(1.0).sample(2, np.random.default_rng(3))
    assert [r.arrival_time for r in requests] == [starts[0], starts[1], starts[0] + 100.0]

    plain = sharegpt_multi_turn_requests(tokenizer=tokenizer, conversations=conversations[:1], chat_template=False)
    assert tokenizer.decode(plain[1].prompt_token_ids.tolist()) == "Hi there\nHello! How can I help?\nTell me a joke\n"
    assert np.array_equal(plain[1].prompt_token_ids[: plain[0].prompt_len], plain[0].prompt_token_ids)


def test_multi_turn_on_sharegpt_respects_limits(tokenizer, first_conversations) -> None:
    requests = sharegpt_multi_turn_requests(
        12, tokenizer=tokenizer, conversations=first_conversations, max_model_len=1500, max_turns=3
    )
    conversations = {r.request_id.rsplit("-turn", 1)[0] for r in requests}
    assert len(conversations) == 12
    by_id = {r.request_id: r for r in requests}
    for request in requests:
        assert request.prompt_len + request.output_len <= 1500
        turn = int(request.request_id.rsplit("-turn", 1)[1])
        assert turn < 3
        if turn:
            previous = by_id[request.request_id.rsplit("-turn", 1)[0] + f"-turn{turn - 1}"]
            assert np.array_equal(request.prompt_token_ids[: previous.prompt_len], previous.prompt_token_ids)
            assert request.shared_prefix_len == previous.prompt_len
