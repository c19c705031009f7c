"""ModelRunner: packed paged forward of transformers models against transformers itself.

The steps are built by hand here (a tiny block allocator, no Rust scheduler), with the field
names of the Rust ``SchedulerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedkv.config import CacheConfig, KVGeometry, ModelConfig
from pagedkv.errors import ConfigError, InvalidArgumentError, ModelLoadError, UnsupportedModelError
from pagedkv.kernels.layer_attention import FULL_ATTENTION
from pagedkv.worker.attention_backend import AttentionCall
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.model_support import check_config, check_probe, layer_attentions
from pagedkv.worker.step_input import StepInput

BLOCK_SIZE = 16


# A hand-built step: the runner's step contract (pagedkv.worker.step_input).
Step = StepInput


@dataclass
class Seq:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


class BlockCounter:
    """Hands out fresh block ids (no reuse: tests only)."""

    def __init__(self) -> None:
        self.next_id = 0

    def take(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def make_step(
    pool: BlockCounter,
    chunks: list[tuple[Seq, int]],
    copy_ops: list[tuple[int, int]] = (),
    block_size: int = BLOCK_SIZE,
) -> Step:
    """Schedule the next ``n`` uncomputed tokens of each sequence; sample where a chunk ends
    at the last known token."""
    ids, positions, slots, cu, seq_lens, logits_indices = [], [], [], [0], [], []
    for seq, n in chunks:
        start, end = seq.num_computed, seq.num_computed + n
        assert end <= len(seq.tokens)
        while len(seq.blocks) * block_size < end:
            seq.blocks.append(pool.take())
        ids += seq.tokens[start:end]
        positions += range(start, end)
        slots += [seq.blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]
        cu.append(cu[-1] + n)
        seq_lens.append(end)
        if end == len(seq.tokens):
            logits_indices.append(cu[-1] - 1)
        seq.num_computed = end
    width = max(len(seq.blocks) for seq, _ in chunks)
    tables = np.full((len(chunks), width), -1, dtype=np.int32)  # -1: padding
    for row, (seq, _) in enumerate(chunks):
        tables[row, : len(seq.blocks)] = seq.blocks
    return Step(
        input_ids=np.array(ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        cu_seqlens_q=np.array(cu, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_tables=tables,
        slot_mapping=np.array(slots, dtype=np.int64),
        logits_indices=np.array(logits_indices, dtype=np.int64),
        copy_ops=np.array(copy_ops, dtype=np.int32).reshape(-1, 2),
    )


def hf_last_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def assert_greedy_matches(model, prompt: list[int], generated: list[int]) -> None:
    """``generated`` starts with transformers' own greedy continuation (which may stop at eos)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(generated), do_sample=False, pad_token_id=0)
    expected = out[0, len(prompt) :].tolist()
    assert len(expected) >= 2
    assert generated[: len(expected)] == expected


# ---------------------------------------------------------------- SmolLM2 (the default model)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(
        ModelConfig(None, dtype="float32", device="cpu"), CacheConfig(block_size=BLOCK_SIZE, num_blocks=128)
    )


@pytest.fixture(scope="module")
def hf_model(runner: ModelRunner):
    """The same checkpoint with transformers' own attention (sdpa) and cache."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(runner.model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(runner: ModelRunner) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(runner.model_path)
    questions = ["What is the capital of France?", "Write a haiku about the sea and the wind in autumn.", "2+2="]
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions[:2]
    ]
    encoded = [tokenizer.encode(text) for text in chats] + [tokenizer.encode(questions[2])]
    assert len({len(p) for p in encoded}) == 3  # different lengths
    return encoded


def test_runner_reports_geometry(runner: ModelRunner) -> None:
    assert (runner.num_layers, runner.num_heads, runner.num_kv_heads, runner.head_dim) == (30, 9, 3, 64)
    assert runner.vocab_size == 49152 and runner.max_model_len == 8192
    assert runner.eos_token_ids == [2]  # <|im_end|>
    assert runner.bytes_per_block == 2 * 30 * BLOCK_SIZE * 3 * 64 * 4
    assert runner.kv_cache_bytes == 128 * runner.bytes_per_block
    key_cache, value_cache = runner.kv_caches[7]
    assert key_cache.shape == value_cache.shape == (128, BLOCK_SIZE, 3, 64)


def test_packed_prefill_and_decode_match_transformers(runner, hf_model, prompts) -> None:
    pool = BlockCounter()
    seqs = [Seq(list(p)) for p in prompts]
    logits = runner.execute(make_step(pool, [(s, len(s.tokens)) for s in seqs]))
    assert logits.shape == (3, runner.vocab_size) and logits.dtype == torch.float32
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], hf_last_logits(hf_model, prompt), rtol=1e-4, atol=1e-3)

    num_new = 6
    generated: list[list[int]] = [[] for _ in seqs]
    for _ in range(num_new):
        next_tokens = logits.argmax(dim=-1).tolist()
        for seq, out, token in zip(seqs, generated, next_tokens):
            seq.tokens.append(token)
            out.append(token)
        if len(generated[0]) == num_new:
            break
        logits = runner.execute(make_step(pool, [(s, 1) for s in seqs]))
    for prompt, out in zip(prompts, generated):
        assert_greedy_matches(hf_model, prompt, out)


def test_chunked_prefill_equals_one_shot(runner, prompts) -> None:
    tokens = prompts[1]
    one_shot = runner.execute(make_step(BlockCounter(), [(Seq(list(tokens)), len(tokens))]))

    pool = BlockCounter()
    chunked, other = Seq(list(tokens)), Seq(list(prompts[2]))
    first = runner.execute(make_step(pool, [(chunked, 21)]))  # ends mid-block, samples nothing
    assert first.shape == (0, runner.vocab_size)
    # The second chunk extends the cached prefix, packed with another sequence's prefill.
    rest = runner.execute(make_step(pool, [(other, len(other.tokens)), (chunked, len(tokens) - 21)]))
    torch.testing.assert_close(rest[1], one_shot[0], rtol=1e-4, atol=1e-4)


def test_copy_blocks_copies_every_layer(runner) -> None:
    with torch.inference_mode():
        runner.kv_cache[:, :, 100:104].copy_(torch.randn_like(runner.kv_cache[:, :, 100:104]))
        before = runner.kv_cache.clone()
    runner.copy_blocks(np.array([[100, 110], [102, 111]], dtype=np.int32))
    assert torch.equal(runner.kv_cache[:, :, 110], before[:, :, 100])
    assert torch.equal(runner.kv_cache[:, :, 111], before[:, :, 102])
    untouched = [b for b in range(runner.num_blocks) if b not in (110, 111)]
    assert torch.equal(runner.kv_cache[:, :, untouched], before[:, :, untouched])
    with pytest.raises(InvalidArgumentError, match="block id"):
        runner.copy_blocks(np.array([[0, runner.num_blocks]], dtype=np.int32))


def test_copy_on_write_fork(runner, hf_model, prompts) -> None:
    """A forked sequence shares the prompt's blocks; its first write into the shared last
    block goes to a private copy made by the step's copy op."""
    pool = BlockCounter()
    parent = Seq(list(prompts[0]))
    runner.execute(make_step(pool, [(parent, len(parent.tokens))]))
    assert len(parent.tokens) % BLOCK_SIZE != 0  # the last block is partly filled and shared
    child = Seq(list(parent.tokens), blocks=list(parent.blocks), num_computed=parent.num_computed)
    private = pool.take()
    child.blocks[-1] = private
    parent.tokens.append(11)
    child.tokens.append(22)
    logits = runner.execute(make_step(pool, [(parent, 1), (child, 1)], copy_ops=[(parent.blocks[-1], private)]))
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, parent.tokens), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(logits[1], hf_last_logits(hf_model, child.tokens), rtol=1e-4, atol=1e-3)


def test_bad_steps_raise(runner, prompts) -> None:
    step = make_step(BlockCounter(), [(Seq(list(prompts[2])), len(prompts[2]))])
    step.positions = step.positions[:-1]
    with pytest.raises(InvalidArgumentError, match="one entry per token"):
        runner.execute(step)
    step = make_step(BlockCounter(), [(Seq(list(prompts[2])), len(prompts[2]))])
    step.cu_seqlens_q = step.cu_seqlens_q[:-1]
    with pytest.raises(InvalidArgumentError, match="cu_seqlens_q"):
        runner.execute(step)


def test_missing_model_folder_raises(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelRunner(ModelConfig(str(tmp_path / "nope"), device="cpu"))


# ---------------------------------------------------------------- tiny random models


def _save_tiny(tmp_path_factory, name: str, config) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return str(folder)


_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_tiny_models_match_transformers(tmp_path_factory, model_type: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"sliding_window": None} if model_type == "mistral" else {}
    config = AutoConfig.for_model(model_type, **_TINY, **extra)
    path = _save_tiny(tmp_path_factory, model_type, config)
    runner = ModelRunner(ModelConfig(path, dtype="float32", device="cpu"), CacheConfig(block_size=8, num_blocks=32))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    pool = BlockCounter()
    rng = np.random.default_rng(1)
    seqs = [Seq(rng.integers(0, 256, size=n).tolist()) for n in (5, 19, 12)]
    prompts = [list(s.tokens) for s in seqs]
    logits = runner.execute(make_step(pool, [(s, len(s.tokens)) for s in seqs], block_size=8))
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], hf_last_logits(reference, prompt), rtol=1e-4, atol=1e-4)
    generated: list[list[int]] = [[] for _ in seqs]
    for _ in range(4):
        for seq, out, token in zip(seqs, generated, logits.argmax(dim=-1).tolist()):
            seq.tokens.append(token)
            out.append(token)
        logits = runner.execute(make_step(pool, [(s, 1) for s in seqs], block_size=8))
    for prompt, out in zip(prompts, generated):
        assert_greedy_matches(reference, prompt, out)


def test_a_window_as_long_as_the_context_is_full_attention(tmp_path_factory) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model("mistral", **_TINY, sliding_window=32)
    path = _save_tiny(tmp_path_factory, "mistral_swa", config)
    runner = ModelRunner(ModelConfig(path, dtype="float32", device="cpu"), CacheConfig(num_blocks=16))
    assert [layer.sliding_window for layer in runner.layer_attention] == [32, 32]
    # When the served context fits in the window, the window never slides: the plain kernels.
    runner = ModelRunner(ModelConfig(path, dtype="float32", device="cpu", max_model_len=32), CacheConfig(num_blocks=8))
    assert all(layer.is_full for layer in runner.layer_attention)


@pytest.mark.parametrize(
    ("model_type", "overrides", "fragment"),
    [
        ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
        ("bloom", {"n_embed": 64, "n_layer": 2, "n_head": 4}, "ALiBi"),
        ("t5", {"d_model": 64, "num_layers": 1, "num_heads": 2, "d_kv": 16, "d_ff": 64}, "encoder-decoder"),
    ],
)
def test_unsupported_architectures_are_refused(tmp_path_factory, model_type, overrides, fragment) -> None:
    from transformers import AutoConfig

    base = {} if model_type in ("bloom", "t5") else dict(_TINY)
    config = AutoConfig.for_model(model_type, **{**base, **overrides, "vocab_size": 256})
    folder = tmp_path_factory.mktemp(model_type)
    config.save_pretrained(folder)  # the check runs on the config, before any weights load
    with pytest.raises(UnsupportedModelError, match=fragment):
        ModelRunner(ModelConfig(str(folder), dtype="float32", device="cpu"), CacheConfig(num_blocks=8))


# ---------------------------------------------------------------- the checks, on their own


def _call(layer_idx, q=(1, 4, 5, 16), k=(1, 2, 5, 16), v=None, mask=False, **extras) -> AttentionCall:
    return AttentionCall(
        layer_idx=layer_idx,
        query_shape=q,
        key_shape=k,
        value_shape=v or k,
        scaling=0.25,
        has_mask=mask,
        extras=extras,
    )


def test_check_probe_accepts_plain_attention() -> None:
    config = SimpleNamespace(model_type="toy", num_hidden_layers=2)
    geometry = check_probe([_call(1), _call(0)], config, num_probe_tokens=5, max_model_len=64)
    assert (geometry.num_layers, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim) == (2, 4, 2, 16)
    # A window that covers the whole served context is full attention.
    check_probe([_call(0, sliding_window=64), _call(1)], config, 5, max_model_len=64)


@pytest.mark.parametrize(
    ("calls", "fragment"),
    [
        ([], "AttentionInterface"),
        ([_call(0)], r"layers \[0\] of 2"),
        ([_call(0), _call(0)], r"layers \[0\] of 2"),
        ([_call(0), _call(None)], "layer_idx"),
        ([_call(0), _call(1, k=(1, 2, 9, 16))], "cross-attention"),
        ([_call(0), _call(1, v=(1, 2, 5, 32))], "head dims"),
        ([_call(0), _call(1, k=(1, 3, 5, 16))], "KV heads"),
        ([_call(0), _call(1, mask=True)], "mask"),
        ([_call(0), _call(1, attention_chunk_size=16)], "attention_chunk_size=16"),
        ([_call(0), _call(1, is_causal=False)], "is_causal"),
        ([_call(0), _call(1, q=(1, 2, 5, 16))], "different attention shapes"),
    ],
)
def test_check_probe_refuses(calls, fragment: str) -> None:
    config = SimpleNamespace(model_type="toy", num_hidden_layers=2)
    with pytest.raises(UnsupportedModelError, match=fragment):
        check_probe(calls, config, num_probe_tokens=5, max_model_len=64)


@pytest.mark.parametrize(
    ("attributes", "fragment"),
    [
        ({"layer_types": ["full_attention", "linear_attention"]}, "linear_attention"),
        ({"layer_types": ["full_attention", "mamba"]}, "hybrid"),
        ({"attn_temperature_tuning": True, "floor_scale": 64}, "temperature tuning"),
        ({"alibi": True}, "ALiBi"),
        ({"attn_config": {"alibi": True}}, "ALiBi"),
        ({"cross_attention_layers": [1]}, "cross-attention"),
    ],
)
def test_check_config_refuses(attributes: dict, fragment: str) -> None:
    with pytest.raises(UnsupportedModelError, match=fragment):
        check_config(SimpleNamespace(model_type="toy", **attributes), max_model_len=64)


def test_check_config_accepts_windows_chunks_and_soft_caps() -> None:
    check_config(SimpleNamespace(model_type="toy", sliding_window=8, layer_types=["sliding_attention"]), 64)
    check_config(SimpleNamespace(model_type="toy", attention_chunk_size=8, layer_types=["chunked_attention"]), 64)
    check_config(SimpleNamespace(model_type="toy", attn_logit_softcapping=50.0), 64)
    # Llama 4's temperature tuning is exact while positions and step sizes stay below floor_scale - 1.
    check_config(SimpleNamespace(model_type="toy", attn_temperature_tuning=True, floor_scale=8192), 64, 2048)


def _probe_config(**attributes) -> SimpleNamespace:
    return SimpleNamespace(model_type="toy", num_hidden_layers=2, **attributes)


def test_layer_attentions_follow_the_config_and_the_calls() -> None:
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.bfloat16)
    config = _probe_config(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    layers = layer_attentions([_call(1, softcap=30.0, s_aux=sinks), _call(0, sliding_window=8)], config, 64)
    assert (layers[0].sliding_window, layers[0].logits_soft_cap, layers[0].sinks) == (8, None, None)
    assert (layers[1].sliding_window, layers[1].logits_soft_cap) == (None, 30.0)
    assert layers[1].sinks.dtype == torch.float32 and layers[1].sinks.tolist() == sinks.float().tolist()
    # The config decides the window even when the layer does not pass it (its mask would).
    assert layer_attentions([_call(0), _call(1)], config, 64)[0].sliding_window == 8
    # Without layer_types, the window a layer passes is its own (Mistral).
    assert [
        la.sliding_window for la in layer_attentions([_call(0, sliding_window=8), _call(1)], _probe_config(), 64)
    ] == [8, None]
    # Plain layers are the kernels' FULL_ATTENTION singleton (their unchanged fast path).
    assert all(la is FULL_ATTENTION for la in layer_attentions([_call(0), _call(1)], _probe_config(), 64))
    # Chunks from the config; windows and chunks that never limit anything are dropped.
    chunked = _probe_config(attention_chunk_size=16, layer_types=["chunked_attention", "full_attention"])
    assert [la.chunk_size for la in layer_attentions([_call(0), _call(1)], chunked, 64)] == [16, None]
    assert all(la.is_full for la in layer_attentions([_call(0), _call(1)], chunked, 16))
    assert all(la.is_full for la in layer_attentions([_call(0, sliding_window=64), _call(1)], _probe_config(), 64))


@pytest.mark.parametrize(
    ("config", "calls", "fragment"),
    [
        # The layer's flash-attention window disagrees with the mask the config builds.
        (
            _probe_config(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
            [_call(0, sliding_window=4), _call(1)],
            "passes sliding_window=4",
        ),
        (
            _probe_config(sliding_window=8, layer_types=["full_attention", "full_attention"]),
            [_call(0, sliding_window=8), _call(1)],
            "'full_attention' in the config",
        ),
        (_probe_config(sliding_window=0, layer_types=["sliding_attention"] * 2), [_call(0), _call(1)], ">= 1"),
        (_probe_config(), [_call(0, softcap=-1.0), _call(1)], "logits_soft_cap"),
        (_probe_config(), [_call(0, s_aux=torch.zeros(2, 2)), _call(1)], "sinks"),
        (_probe_config(), [_call(0, s_aux=torch.zeros(3)), _call(1)], "3 logits but the query has 4 heads"),
    ],
)
def test_layer_attentions_refuse_bad_configs(config, calls, fragment: str) -> None:
    with pytest.raises(UnsupportedModelError, match=fragment):
        layer_attentions(calls, config, 64)


# ---------------------------------------------------------------- the step metadata, once per step


def _decode_batch(runner: ModelRunner, prompts) -> tuple[BlockCounter, list[Seq]]:
    pool = BlockCounter()
    seqs = [Seq(list(p)) for p in prompts]
    logits = runner.execute(make_step(pool, [(s, len(s.tokens)) for s in seqs]))
    for seq, token in zip(seqs, logits.argmax(dim=-1).tolist()):
        seq.tokens.append(token)
    return pool, seqs


def test_step_metadata_is_validated_once_per_step_not_per_layer(runner, prompts, monkeypatch) -> None:
    from pagedkv.kernels import validation

    pool, seqs = _decode_batch(runner, prompts)
    calls = {"step": 0, "values": 0, "layer": 0, "per_call": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(validation, "check_step_metadata", counting("step", validation.check_step_metadata))
    monkeypatch.setattr(validation, "_check_batch_values", counting("values", validation._check_batch_values))
    monkeypatch.setattr(validation, "check_layer_attention", counting("layer", validation.check_layer_attention))
    for name in ("check_paged_attention_args", "check_store_kv_args"):
        monkeypatch.setattr(validation, name, counting("per_call", getattr(validation, name)))
    # A mixed step: two decodes and a chunk of a new prompt.
    fresh = Seq(list(prompts[0]))
    runner.execute(make_step(pool, [(seqs[0], 1), (seqs[1], 1), (fresh, 9)]))
    assert calls == {"step": 1, "values": 1, "layer": runner.num_layers, "per_call": 0}


def test_bad_step_metadata_raises_before_anything_runs(runner, prompts) -> None:
    pool, seqs = _decode_batch(runner, prompts)
    spare = pool.take()

    def step_with(**changes):
        step = make_step(
            BlockCounter(),
            [(Seq(list(s.tokens), list(s.blocks), s.num_computed), 1) for s in seqs],
            copy_ops=[(seqs[0].blocks[0], spare)],
        )
        for name, value in changes.items():
            setattr(step, name, value)
        return step

    good = step_with()
    bad_tables = good.block_tables.copy()
    bad_tables[1, 0] = runner.num_blocks
    decreasing = good.cu_seqlens_q.copy()
    decreasing[1], decreasing[2] = 2, 1
    cases = [
        (dict(block_tables=bad_tables), f"block id {runner.num_blocks}"),
        (dict(slot_mapping=good.slot_mapping + runner.num_blocks * BLOCK_SIZE), "slot_mapping holds slot"),
        (dict(cu_seqlens_q=decreasing), "non-decreasing"),
        (dict(seq_lens=good.seq_lens + 10 * BLOCK_SIZE), r"seq_lens\[\d\] = \d+ is outside"),
        (dict(seq_lens=good.seq_lens.astype(np.float32)), "seq_lens must hold integers"),
        (dict(input_ids=good.input_ids + runner.vocab_size), "input_ids holds token id"),
        (dict(logits_indices=good.logits_indices + 5), "logits_indices holds row"),
    ]
    with torch.inference_mode():
        before = runner.kv_cache[:, :, spare].clone()
        runner.kv_cache[:, :, seqs[0].blocks[0]].add_(1.0)  # so that a copy would show
    for changes, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            runner.execute(step_with(**changes))
        # Checked before the copy-on-write ops and the forward: nothing was written.
        assert torch.equal(runner.kv_cache[:, :, spare], before)


# ---------------------------------------------------------------- configuration and limits


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> str:
    from transformers import AutoConfig

    return _save_tiny(tmp_path_factory, "qwen2_limits", AutoConfig.for_model("qwen2", **_TINY))


def test_runner_takes_the_validated_configs(tiny_qwen2) -> None:
    runner = ModelRunner(
        ModelConfig(tiny_qwen2, dtype="float32", device="cpu", attention_backend="torch"),
        CacheConfig(block_size=8, kv_cache_memory=64 * 4096 + 100),
    )
    assert isinstance(runner.geometry, KVGeometry)
    assert (
        runner.geometry.num_layers,
        runner.geometry.num_heads,
        runner.geometry.num_kv_heads,
        runner.geometry.head_dim,
        runner.geometry.dtype,
    ) == (2, 4, 2, 16, "float32")
    assert runner.bytes_per_block == runner.geometry.bytes_per_block(8) == 2 * 2 * 8 * 2 * 16 * 4 == 4096
    assert runner.num_blocks == 64 and runner.attention_backend == runner.backend.name == "torch"
    with pytest.raises(ConfigError, match="cache_config must be a pagedkv.config.CacheConfig"):
        ModelRunner(ModelConfig(tiny_qwen2, device="cpu"), {"num_blocks": 8})  # type: ignore[arg-type]


def test_a_pool_beyond_the_core_limits_is_refused_before_loading() -> None:
    from pagedkv._core import MAX_BLOCK_SIZE, MAX_NUM_BLOCKS

    with pytest.raises(ConfigError, match=f"num_blocks must be at most {MAX_NUM_BLOCKS}.*got 1000000000000"):
        CacheConfig(num_blocks=10**12)
    with pytest.raises(ConfigError, match=f"block_size must be a power of two in 8 .. {MAX_BLOCK_SIZE}, got 8192"):
        CacheConfig(block_size=2 * MAX_BLOCK_SIZE)


def test_a_pool_larger_than_memory_is_refused_before_allocation(tiny_qwen2, monkeypatch) -> None:
    import pagedkv.worker.kv_cache_plan as kv_cache_plan

    monkeypatch.setattr(kv_cache_plan, "_available_memory", lambda device: 1 << 30)
    model = ModelConfig(tiny_qwen2, dtype="float32", device="cpu")
    with pytest.raises(
        ConfigError,
        match=r"would take 4,294,967,296 bytes \(1048576 blocks x 4,096 bytes\), "
        r"more than the 1,073,741,824 bytes available",
    ):
        ModelRunner(model, CacheConfig(block_size=8, num_blocks=1 << 20))
    # A byte budget past MAX_NUM_BLOCKS blocks: clamped (with a warning), then still too big here.
    with pytest.warns(UserWarning, match="clamped to 16777216 blocks"), pytest.raises(ConfigError, match="available"):
        ModelRunner(model, CacheConfig(block_size=8, kv_cache_memory=10**15))


def test_a_budget_past_max_num_blocks_is_clamped_with_a_warning(tiny_qwen2, monkeypatch) -> None:
    import pagedkv.worker.kv_cache_plan as kv_cache_plan

    monkeypatch.setattr(kv_cache_plan, "MAX_NUM_BLOCKS", 64)  # a small stand-in for 2^24
    with pytest.warns(UserWarning, match=r"kv_cache_memory=1048576 makes room for 256 blocks .* clamped to 64"):
        runner = ModelRunner(
            ModelConfig(tiny_qwen2, dtype="float32", device="cpu"), CacheConfig(block_size=8, kv_cache_memory=1 << 20)
        )
    assert runner.num_blocks == 64 and runner.kv_cache.shape[2] == 64


def test_max_model_len_above_the_declared_context_warns(tiny_qwen2) -> None:
    with pytest.warns(UserWarning, match=r"max_model_len = 512 is above the context length the model declares \(256\)"):
        runner = ModelRunner(
            ModelConfig(tiny_qwen2, dtype="float32", device="cpu", max_model_len=512),
            CacheConfig(block_size=8, num_blocks=64),
        )
    assert runner.max_model_len == 512


def test_set_up_warnings_point_at_the_code_that_built_the_runner(tiny_qwen2, monkeypatch) -> None:
    import pagedkv.worker.kv_cache_plan as kv_cache_plan

    monkeypatch.setattr(kv_cache_plan, "MAX_NUM_BLOCKS", 64)
    with pytest.warns(UserWarning) as record:
        ModelRunner(
            ModelConfig(tiny_qwen2, dtype="float32", device="cpu", max_model_len=512),
            CacheConfig(block_size=8, kv_cache_memory=1 << 20, host_kv_cache_memory=1 << 20),
        )
    messages = [str(w.message) for w in record]
    assert any("max_model_len = 512" in m for m in messages) and sum("clamped to 64" in m for m in messages) == 2
    assert {w.filename for w in record} == {__file__}


# ---------------------------------------------------------------- the step contract


def test_the_scheduler_output_has_every_field_of_the_step_contract() -> None:
    """The engine hands the runner the Rust SchedulerOutput as it is: it must have every array
    the runner reads (StepArrays), and a hand-built StepInput every field of a ModelStep."""
    from pagedkv import SchedulerOutput
    from pagedkv.worker.step_input import ModelStep, StepArrays

    arrays = [name for name in vars(StepArrays) if not name.startswith("_")]
    assert len(arrays) == 12
    assert [name for name in arrays if not hasattr(SchedulerOutput, name)] == []
    step = StepInput(
        input_ids=np.zeros(1, dtype=np.int64),
        positions=np.zeros(1, dtype=np.int64),
        slot_mapping=np.zeros(1, dtype=np.int64),
        cu_seqlens_q=np.array([0, 1], dtype=np.int32),
        seq_lens=np.ones(1, dtype=np.int32),
        block_tables=np.zeros((1, 1), dtype=np.int32),
        logits_indices=np.zeros(1, dtype=np.int64),
    )
    for name in [*arrays, *(n for n in vars(ModelStep) if not n.startswith("_"))]:
        assert hasattr(step, name), name
    assert step.hidden_rows is None and step.swap_in.shape == (0, 2) and step.disk_load.dtype == np.int32


def test_the_worker_does_not_import_the_parallel_package() -> None:
    """parallel/ builds runners and imports the worker; the worker reaches tensor parallelism
    only through its ParallelRank protocol (no import loop)."""
    import ast
    from pathlib import Path

    import pagedkv.worker

    found = []
    for path in sorted(Path(pagedkv.worker.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.startswith("pagedkv.parallel")]
    assert found == []
