"""``enforce_eager=False`` (pagedkv.worker.compiled_forward): which forwards run compiled, the
attention op outside a compiled forward, and the engine's greedy tokens through the compiled
forward against eager (the tiny model; greedy equality with transformers is the ``compiled``
case of tests/engine/test_engine_greedy.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from pagedkv import LLM, SamplingParams
from pagedkv.config import ENFORCE_EAGER_ENV_VAR, ModelConfig, resolve_enforce_eager, resolve_linear_kernel
from pagedkv.errors import ConfigError
from pagedkv.worker import compiled_artifact, compiled_forward
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


def test_no_compiler_pass_may_drop_the_attention_op() -> None:
    """The op stores K/V, a side effect its schema does not show: marked impure, dead-code
    elimination keeps a call whose output reaches no logit (a graph specialised for a step that
    samples no row once dropped the last layer's call, and its K/V)."""
    from torch._library.utils import is_impure

    import pagedkv.worker.cpu_linear  # noqa: F401  (registers pagedkv::cpu_linear)

    assert is_impure(torch.ops.pagedkv.paged_attention_step.default)
    assert not is_impure(torch.ops.pagedkv.cpu_linear.default)  # a pure product: droppable


def test_enforce_eager_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="enforce_eager"):
        ModelConfig(enforce_eager="no")  # type: ignore[arg-type]


class _OpCalls:
    """Counts, per step, the layers whose attention op ran (the op calls the eager attention
    function through ``compiled_forward``'s module global)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, llm: LLM) -> None:
        self.steps: list[tuple[int, int, set[int]]] = []  # (tokens, sampled rows, layers)
        self._layers: set[int] = set()
        original = compiled_forward.pagedkv_attention_forward

        def counting(module, *args, **kwargs):
            self._layers.add(module.layer_idx)
            return original(module, *args, **kwargs)

        monkeypatch.setattr(compiled_forward, "pagedkv_attention_forward", counting)
        runner = llm.llm_engine.runner
        forward = runner._forward

        def recording(input_ids, positions, logits_indices, context, hidden_rows=None):
            self._layers = set()
            out = forward(input_ids, positions, logits_indices, context, hidden_rows)
            self.steps.append((input_ids.shape[0], logits_indices.shape[0], self._layers))
            return out

        monkeypatch.setattr(runner, "_forward", recording)


@pytest.mark.parametrize("extra", [{}, {"quantization": "int8"}], ids=["defaults", "int8"])
def test_compiled_engine_generates_what_eager_does(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, extra: dict
) -> None:
    """One graph serves every step (decodes of one and of several sequences, prefill chunks that
    sample no row), every layer's attention runs in every step (a chunk that samples nothing
    once lost its last layer's K/V to dead-code elimination), and the tokens are eager's. The
    forward is made as the engine starts and saved; a restart in another process loads it
    (:func:`_check_a_restart_loads`, on the int8 case's). ``defaults``: an engine given no
    ``enforce_eager`` and no ``linear_kernel`` on the CPU compiles, with pagedkv's kernel."""
    prompts = ["Hello, my name is", "The capital of France is a city that", "1, 2, 3,", "one two three " * 12]
    long_alone = "four five six seven " * 10
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    common = {"model": tiny_model, "tokenizer": str(default_model_dir()), "dtype": "float32", "device": "cpu"}
    common |= {"max_model_len": 256, "kv_cache_memory": 16 << 20, "max_num_batched_tokens": 16} | extra
    eager = LLM(**common, enforce_eager=True).generate([*prompts, long_alone], params, use_tqdm=False)
    graphs_before = counters["stats"]["unique_graphs"]
    if extra:
        llm = LLM(**common, enforce_eager=False)
    else:  # what a user gets who sets nothing (tests/conftest.py pins eager for the suite)
        monkeypatch.delenv(ENFORCE_EAGER_ENV_VAR, raising=False)
        llm = LLM(**common)
        assert llm.llm_engine.runner.linear_kernel == "pagedkv"
    forward = llm.llm_engine.runner.compiled_forward
    assert forward is not None and forward.origin is not None  # made at start
    calls = _OpCalls(monkeypatch, llm)
    compiled = llm.generate(prompts, params, use_tqdm=False)
    # pagedkv's linears and int8 weights take the weights as the graph's inputs, so the forward is
    # captured whole and saved (torch's linears compile frozen, their weights constants of the
    # graph: never saved; the compiled-torch-linears case of tests/engine/test_engine_greedy.py).
    # (the defaults' forward may already be saved by another test of this process: loaded then)
    assert forward.origin == "captured" if extra else forward.origin in ("captured", "loaded")
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager[:-1]]
    # A long prompt alone: chunks that sample no row, then one-token decode steps.
    alone = llm.generate([long_alone], params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == eager[-1].outputs[0].token_ids
    assert counters["stats"]["unique_graphs"] - graphs_before == (1 if forward.origin == "captured" else 0)
    kinds = {(tokens == 1, sampled) for tokens, sampled, _ in calls.steps}
    assert {(True, 1), (False, 0)} <= kinds  # a lone decode and a chunk that samples nothing
    layers = set(range(llm.llm_engine.runner.num_layers))
    assert all(ran == layers for _, _, ran in calls.steps), calls.steps
    if extra:  # saved: a restart loads it
        tokens = [o.outputs[0].token_ids for o in compiled]
        _check_a_restart_loads({**common, "enforce_eager": False}, prompts, params, tokens, forward.artifact_path)


@pytest.mark.parametrize(
    "explicit, pinned, device, eager",
    [
        (None, None, "cpu", False),  # compiled on the CPU
        (None, None, "cuda", True),  # eager on a GPU
        (None, "1", "cpu", True),
        (None, "0", "cuda", False),
        (True, "0", "cpu", True),  # an explicit value wins
        (False, "1", "cpu", False),
    ],
)
def test_enforce_eager_defaults_to_compiled_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, explicit: bool | None, pinned: str | None, device: str, eager: bool
) -> None:
    if pinned is None:
        monkeypatch.delenv(ENFORCE_EAGER_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENFORCE_EAGER_ENV_VAR, pinned)
    assert resolve_enforce_eager(explicit, device) is eager


def test_a_bad_pinned_enforce_eager_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENFORCE_EAGER_ENV_VAR, "sometimes")
    with pytest.raises(ConfigError, match="PAGEDKV_ENFORCE_EAGER must be 1 or 0"):
        resolve_enforce_eager(None, "cpu")


def test_the_auto_linear_kernel_is_pagedkvs_where_it_applies() -> None:
    assert resolve_linear_kernel("auto", "cpu", "float32", None) == "pagedkv"
    assert resolve_linear_kernel("auto", "cpu", "float32", "int8") == "torch"  # int8 has its own
    assert resolve_linear_kernel("auto", "cpu", "bfloat16", None) == "torch"
    assert resolve_linear_kernel("auto", "cuda", "float32", None) == "torch"
    assert resolve_linear_kernel("onednn", "cpu", "float32", None) == "onednn"  # a pinned choice stays
    assert ModelConfig(linear_kernel="default").linear_kernel == "torch"  # its name while it was the default


def test_windowed_models_compile(tmp_path) -> None:
    """Sliding-window, soft-capped and full layers (tiny Gemma 2, KV cache groups) compiled:
    transformers' greedy tokens and logprobs on prompts prefilled in chunks several windows
    long (the case the compiled forward once got wrong)."""
    from test_attention_types import PROMPTS, _build, _check_greedy, _engine, _greedy_reference, _reference

    folder = _build(tmp_path / "gemma2", "gemma2")
    expected = [_greedy_reference(_reference(folder), p) for p in PROMPTS]
    llm = _engine(folder, enforce_eager=False)
    assert llm.llm_engine.runner.compiled_forward is not None
    _check_greedy(llm, expected)


_RESTART = r"""
import json, sys
from pagedkv import LLM, SamplingParams
from torch._dynamo.utils import counters
engine_args, prompts, max_tokens = (json.loads(arg) for arg in sys.argv[1:4])
llm = LLM(**engine_args)
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
out = llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({
    "origin": llm.llm_engine.runner.compiled_forward.origin,
    "graphs": counters["stats"]["unique_graphs"],
    "tokens": [o.outputs[0].token_ids for o in out],
}), flush=True)
# Without the interpreter's teardown: a process that ran a loaded forward has crashed in it
# (SIGSEGV after this output, no Python frame, under load in make test; an open problem,
# noted in the issue's closing note). What this check is about is above: the forward loads and
# gives the first process's tokens.
import os
os._exit(0)
"""


def _check_a_restart_loads(engine_args: dict, prompts: list[str], params: SamplingParams, tokens: list, path) -> None:
    """Another process with the same engine arguments (and so the same inductor cache folder,
    tests/conftest.py) loads the forward saved at ``path``, traces nothing (dynamo makes no
    graph) and generates ``tokens``. A saved file that does not load is a warning, not an error."""
    import json
    import subprocess
    import sys

    assert path.is_file() and path.parent == compiled_artifact.artifact_dir()
    restart = subprocess.run(
        # faulthandler: a crash (a signal, no Python traceback) prints every thread's stack.
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-c",
            _RESTART,
            json.dumps(engine_args),
            json.dumps(prompts),
            json.dumps(params.max_tokens),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert restart.returncode == 0, f"stdout: {restart.stdout[-1000:]}\nstderr: {restart.stderr[-6000:]}"
    second = json.loads(restart.stdout.strip().splitlines()[-1])
    assert second == {"origin": "loaded", "graphs": 0, "tokens": tokens}
    # A file that does not load (an interrupted write, another torch's format) is a warning
    # and None, so the engine compiles as on a first start and replaces it.
    path.write_bytes(b"not a compiled forward")
    with pytest.warns(UserWarning, match="did not load"):
        assert compiled_artifact.load_artifact(path, vars(compiled_forward)) is None


def test_the_artifact_key_names_what_the_trace_depends_on() -> None:
    """A loaded forward checks no guard, so its file's key must change with the module tree,
    the call's names, dtypes and ranks, and inductor's options; the weights are inputs, not part
    of it."""
    torch.manual_seed(0)
    call = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "use_cache": False}
    options = {"cpp.threads": 1}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    key = compiled_artifact.artifact_key(model, call, options)
    assert compiled_artifact.artifact_key(torch.nn.Sequential(torch.nn.Linear(4, 4)), call, options) == key
    changed = [
        compiled_artifact.artifact_key(torch.nn.Sequential(torch.nn.Linear(4, 5)), call, options),
        compiled_artifact.artifact_key(torch.nn.Sequential(torch.nn.Linear(4, 4).double()), call, options),
        compiled_artifact.artifact_key(model, {**call, "input_ids": call["input_ids"].int()}, options),
        compiled_artifact.artifact_key(model, {**call, "input_ids": call["input_ids"][0]}, options),
        compiled_artifact.artifact_key(model, {**call, "logits_to_keep": torch.zeros(1)}, options),
        compiled_artifact.artifact_key(model, call, {"cpp.threads": 2}),
    ]
    assert len({key, *changed}) == 1 + len(changed)
