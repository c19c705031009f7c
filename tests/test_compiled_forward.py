"""``enforce_eager=False`` (pagedkv.worker.compiled_forward): which forwards run compiled, the
attention op outside a compiled forward, and the engine's greedy tokens through the compiled
forward against eager (the tiny model; greedy equality with transformers is the ``compiled``
case of tests/test_engine_greedy.py)."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.config import ModelConfig
from pagedkv.errors import ConfigError
from pagedkv.worker.attention_backend import PagedAttentionContext, ProbeContext
from pagedkv.worker.compiled_forward import CompiledForward
from pagedkv.worker.model_files import default_model_dir


def test_only_plain_paged_steps_run_compiled() -> None:
    context = PagedAttentionContext.__new__(PagedAttentionContext)
    assert CompiledForward.applies(context, None)
    assert not CompiledForward.applies(context, object())  # prompt rows as hidden states
    assert not CompiledForward.applies(ProbeContext(), None)


def test_the_op_needs_a_compiled_forward() -> None:
    x = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="only inside a CompiledForward call"):
        torch.ops.pagedkv.paged_attention_step(x, x, x, 0, 0.5)


def test_enforce_eager_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="enforce_eager"):
        ModelConfig(enforce_eager="no")  # type: ignore[arg-type]


def test_compiled_engine_generates_what_eager_does(tiny_model: str) -> None:
    prompts = ["Hello, my name is", "The capital of France is a city that", "1, 2, 3,"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    common = {"model": tiny_model, "tokenizer": str(default_model_dir()), "dtype": "float32", "device": "cpu"}
    common |= {"max_model_len": 256, "kv_cache_memory": 16 << 20}
    eager = LLM(**common).generate(prompts, params, use_tqdm=False)
    llm = LLM(**common, enforce_eager=False)
    assert llm.llm_engine.runner.compiled_forward is not None
    compiled = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
    # One request alone: a one-token decode step (dynamo's own specialisation for size 1).
    alone = llm.generate(prompts[:1], params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == eager[0].outputs[0].token_ids


def test_models_with_other_attention_layers_stay_eager(tmp_path) -> None:
    """Sliding-window (and chunked, soft-capped, sink) layers are refused until the compiled
    path's disagreement on Gemma's chunked prefills is found (worker/model_runner.py)."""
    from test_attention_types import _build, _engine

    folder = _build(tmp_path / "gemma3_text", "gemma3_text")
    with pytest.raises(ConfigError, match="enforce_eager=False is not available yet"):
        _engine(folder, enforce_eager=False)
