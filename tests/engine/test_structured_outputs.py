"""Structured outputs on the engine (SmolLM2, float32, CPU; llguidance masks).

- Every schema of tests/data/json_schemas.json: two samples each at temperature 1 (seeded) parse
  and validate with ``jsonschema``, and end by themselves (``finish_reason="stop"``).
- Schemas with features the grammar engine does not implement are refused with a
  StructuredOutputError naming the feature (never an unconstrained output).
- regex, choice, Lark and GBNF grammars; ``n > 1`` and beam search with a schema (every sample
  and beam valid); a step that fails in the middle of a structured request; the live page's mark.
- On the tiny random model (block bookkeeping): a pool small enough to preempt (recompute, and
  swap to a host tier) in the middle of structured requests; a grammar whose compile waits past
  ``compile_timeout_s`` fails its request alone.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest

from pagedkv import LLM, BeamSearchParams, LLMEngine, SamplingParams
from pagedkv.errors import ConfigError, StructuredOutputError
from pagedkv.structured import StructuredOutputsParams

CORPUS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
SCHEMAS: dict = CORPUS["schemas"]
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "kv_cache_memory": 64 << 20}
PERSON = SCHEMAS["person"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE_ARGS)


def chat(llm: LLM, text: str) -> str:
    tokenizer = llm.llm_engine.tokenizer
    return str(
        tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    )


def check_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_every_schema_of_the_corpus_is_followed(llm: LLM) -> None:
    names = list(SCHEMAS)
    prompts = [chat(llm, f"Reply with JSON matching this schema: {json.dumps(SCHEMAS[n])}") for n in names]
    params = [
        SamplingParams(n=2, temperature=1.0, seed=100 + i, max_tokens=256, structured_outputs={"json": SCHEMAS[n]})
        for i, n in enumerate(names)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for name, out in zip(names, outputs):
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason == "stop", (name, c.text)
            check_valid(c.text, SCHEMAS[name])


@pytest.mark.parametrize("name", sorted(CORPUS["unsupported"]))
def test_unsupported_schema_features_are_refused_by_name(llm: LLM, name: str) -> None:
    schema, feature = CORPUS["unsupported"][name]
    with pytest.raises(StructuredOutputError, match=re.escape(feature)):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs={"json": schema}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_regex_choice_and_grammars(llm: LLM) -> None:
    prompt = chat(llm, "Give me a phone number, then pick an answer.")
    lark = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,8}/'
    gbnf = 'root ::= "(" digit ("," digit)* ")"\ndigit ::= [0-9]'
    constraints = [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, re.compile(r"[0-9]{3}-[0-9]{4}")),
        ({"choice": ["yes", "no", "maybe so"]}, re.compile(r"yes|no|maybe so")),
        ({"grammar": lark}, re.compile(r"(hello|hi) [A-Z][a-z]{1,8}!")),
        ({"grammar": gbnf}, re.compile(r"\([0-9](,[0-9])*\)")),
    ]
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(temperature=temperature, seed=7, max_tokens=48, structured_outputs=c) for c, _ in constraints
        ]
        outputs = llm.generate([prompt] * len(constraints), params, use_tqdm=False)
        for (constraint, pattern), out in zip(constraints, outputs):
            text = out.outputs[0].text
            assert pattern.fullmatch(text), (constraint, text)
            assert out.outputs[0].finish_reason == "stop"


def test_json_object_and_whitespace_option(llm: LLM) -> None:
    prompt = chat(llm, "Describe a cat as JSON.")
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=200, structured_outputs={"json_object": True}),
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=200, structured_outputs={"json": PERSON, "disable_any_whitespace": True}
        ),
    ]
    free, compact = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert isinstance(json.loads(free.outputs[0].text), dict)
    text = compact.outputs[0].text
    check_valid(text, PERSON)
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)


def test_parallel_samples_and_beams_all_follow_the_schema(llm: LLM) -> None:
    prompt = chat(llm, "Invent a person and reply as JSON with a name and an age.")
    out = llm.generate(
        [prompt],
        SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=64, structured_outputs={"json": PERSON}),
        use_tqdm=False,
    )[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1  # forked samples, each with its own matcher
    for text in texts:
        check_valid(text, PERSON)
    beams = llm.beam_search(
        [prompt], BeamSearchParams(beam_width=3, max_tokens=48, structured_outputs={"json": PERSON})
    )
    sequences = beams[0].sequences
    assert len(sequences) == 3
    for seq in sequences:
        assert seq.finish_reason == "stop"
        check_valid(seq.text, PERSON)


def test_constraint_parameters_are_checked() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ConfigError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ConfigError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ConfigError, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ConfigError, match="more than the limit"):
        StructuredOutputsParams(regex="a" * (300 * 1024))


def test_bad_grammar_and_regex_are_refused(llm: LLM) -> None:
    for constraint in ({"regex": "([a-z"}, {"grammar": "start: undefined_rule"}):
        with pytest.raises(StructuredOutputError):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)


def tiny_engine(tiny_model: str, **kwargs: object) -> LLMEngine:
    """The tiny random Qwen2 (SmolLM2's tokenizer): block bookkeeping, not the model. Its JSON
    ends because whitespace is off and every string of the schemas used is bounded."""
    from pagedkv.worker.model_files import default_model_dir

    return LLMEngine(model=tiny_model, tokenizer=str(default_model_dir()), dtype="float32", device="cpu", **kwargs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_the_middle_of_structured_requests(tiny_model: str, mode: str) -> None:
    # 12 blocks of 16 tokens: six requests of ~20 prompt + up to 100 output tokens cannot all
    # stay; some are preempted in the middle of their JSON and resumed.
    host = {"num_host_blocks": 64} if mode == "swap" else {}
    engine = tiny_engine(tiny_model, max_model_len=192, num_blocks=12, preemption_mode=mode, max_num_seqs=6, **host)
    schema = SCHEMAS["nested_required"]
    constraint = {"json": schema, "disable_any_whitespace": True}
    for i in range(6):
        engine.add_request(
            str(i),
            f"Record {i}: a user with a login and an address, as JSON:",
            SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=constraint),
        )
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.get_stats()["num_preemptions"] > 0
    for out in finished.values():
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        check_valid(out.outputs[0].text, schema)
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]  # no block lost


def test_a_failed_step_in_the_middle_leaves_the_matcher_as_it_was(llm: LLM) -> None:
    engine = llm.llm_engine
    prompt = chat(llm, "Invent a person and reply as JSON.")
    reference = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": PERSON}), use_tqdm=False
    )
    # The same request again, with its 4th forward (a decode step, mid-JSON) failing once.
    engine.add_request(
        "fail-mid", prompt, SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": PERSON})
    )
    runner = engine.runner
    original = runner.execute
    calls = {"n": 0}

    def execute(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure in the 4th forward")
        return original(*args, **kwargs)

    runner.execute = execute
    text = None
    try:
        failures = 0
        while engine.has_unfinished_requests():
            try:
                outs = engine.step()
            except RuntimeError:
                failures += 1
                continue
            for out in outs:
                if out.finished:
                    text = out.outputs[0].text
    finally:
        runner.execute = original
    assert failures == 1
    assert text == reference[0].outputs[0].text  # greedy: the same tokens as without the failure
    check_valid(text, PERSON)


def test_a_compile_past_the_time_limit_fails_only_its_request(tiny_model: str) -> None:
    engine = tiny_engine(
        tiny_model,
        max_model_len=256,
        num_blocks=64,
        structured_outputs_config={"compile_timeout_s": 0.2, "compile_workers": 1},
    )
    # The only compile thread is busy (another grammar's compile, held here until released):
    # the new grammar waits in the queue past its limit.
    release = threading.Event()
    compile_one = engine.grammars._compile

    def held(params, key):  # type: ignore[no-untyped-def]
        if params.regex == "[0-9]+":
            release.wait()
        return compile_one(params, key)

    engine.grammars._compile = held  # type: ignore[method-assign]
    busy = engine.grammars.compile(StructuredOutputsParams(regex="[0-9]+"))
    try:
        engine.add_request("slow", "x", SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]+"}))
        engine.add_request("plain", "Hello", SamplingParams(temperature=0.0, max_tokens=4))
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
    finally:
        release.set()
        busy.result()
    # The request that timed out was the only one waiting for its compile, which had not
    # started: it was dropped, not left in the queue.
    assert engine.grammars.num_cancelled == 1 and engine.grammars.num_queued == 0
    assert outputs["slow"].outputs[0].finish_reason == "error"
    assert "longer than 0.2 s" in (outputs["slow"].error or "")
    assert outputs["plain"].outputs[0].finish_reason == "length"
    stats = engine.get_stats()
    assert stats["failed_requests"] == 1 and stats["num_free_blocks"] == stats["num_blocks"]


def test_the_live_page_marks_structured_requests(llm: LLM) -> None:
    from pagedkv.server.dashboard import encode_state

    engine = llm.llm_engine
    engine.compile_grammars([StructuredOutputsParams(json=PERSON)])  # cached: admitted at once
    engine.add_request("page-json", "x", SamplingParams(max_tokens=4, structured_outputs={"json": PERSON}))
    engine.add_request("page-plain", "x", SamplingParams(max_tokens=4))
    try:
        marks = {r["id"]: r["constraint"] for r in encode_state(engine.kv_snapshot(), show_prompts=False)["requests"]}
        assert marks == {"page-json": "json", "page-plain": ""}
    finally:
        engine.abort_request(["page-json", "page-plain"])
