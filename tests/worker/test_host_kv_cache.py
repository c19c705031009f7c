"""The host-memory KV tier: its configuration, its size, and the block swaps of a step.

Swaps are checked bit for bit on the runner's own tensors (float32, int8 and fp8 caches, the
scales of a quantized cache included), and end to end: a decode step whose sequence was
swapped out and back in to other device blocks gives the same logits as without the swap.
Steps are built by hand with the field names of the Rust ``SchedulerOutput``.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from pagedkv.config import MAX_NUM_BLOCKS, CacheConfig, EngineConfig, ModelConfig, SchedulingConfig
from pagedkv.engine.args import EngineArgs
from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.kernels.kv_quant import byte_view
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.step_input import StepInput

BLOCK_SIZE = 16

# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_host_blocks": -1}, r"num_host_blocks must be an int in 0 \.\. 16777216 \(0: no host tier\), got -1"),
        ({"num_host_blocks": MAX_NUM_BLOCKS + 1}, "num_host_blocks .* got 16777217"),
        ({"num_host_blocks": True}, "num_host_blocks .* got True"),
        ({"num_host_blocks": "8"}, "num_host_blocks .* got '8'"),
        ({"num_host_blocks": 8.0}, r"num_host_blocks .* got 8\.0"),
        ({"host_kv_cache_memory": 0}, "host_kv_cache_memory must be a positive number of bytes, got 0"),
        ({"host_kv_cache_memory": -4096}, "host_kv_cache_memory .* got -4096"),
        ({"host_kv_cache_memory": True}, "host_kv_cache_memory .* got True"),
        ({"host_kv_cache_memory": "lots"}, "host_kv_cache_memory .*'lots'"),  # EngineArgs takes "1GiB"
        ({"host_kv_cache_memory": 1.5e9}, "host_kv_cache_memory .* got 1500000000.0"),
        ({"swap_space": 0}, "swap_space must be a positive number of GiB, got 0"),
        ({"swap_space": -1.0}, r"swap_space .* got -1\.0"),
        ({"swap_space": float("nan")}, "swap_space .* got nan"),
        ({"swap_space": float("inf")}, "swap_space .* got inf"),
        ({"swap_space": True}, "swap_space .* got True"),
        ({"swap_space": "4"}, "swap_space .* got '4'"),
        (
            {"num_host_blocks": 8, "swap_space": 1.0},
            r"one of num_host_blocks, host_kv_cache_memory or swap_space, not several "
            r"\(got num_host_blocks=8, swap_space=1\.0\)",
        ),
        ({"num_host_blocks": 0, "host_kv_cache_memory": 4096}, "not several"),
        ({"host_kv_cache_memory": 4096, "swap_space": 1}, "not several"),
        ({"kv_cache_dir": 3}, "kv_cache_dir must be a folder path .* got 3"),
        ({"kv_cache_dir": ""}, "kv_cache_dir must be a folder path .* got ''"),
        ({"kv_cache_dir": b"/tmp"}, "kv_cache_dir must be a folder path"),
        ({"kv_cache_dir": "/tmp/kv", "kv_cache_dir_max_bytes": 0}, "kv_cache_dir_max_bytes must be a positive int"),
        ({"kv_cache_dir": "/tmp/kv", "kv_cache_dir_max_bytes": -1}, "kv_cache_dir_max_bytes .* got -1"),
        ({"kv_cache_dir": "/tmp/kv", "kv_cache_dir_max_bytes": 1.0}, r"kv_cache_dir_max_bytes .* got 1\.0"),
        ({"kv_cache_dir_max_bytes": 1 << 30}, "kv_cache_dir_max_bytes=1073741824 .* kv_cache_dir is not set"),
    ],
)
def test_bad_host_tier_values_are_config_errors(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        CacheConfig(**kwargs)
    with pytest.raises(ConfigError, match=fragment):
        EngineArgs(**kwargs)


@pytest.mark.parametrize("bad", ["swapping", "", None, 1])
def test_bad_preemption_mode_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match=f"preemption_mode must be one of .* got {bad!r}"):
        SchedulingConfig(preemption_mode=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["swap", "auto"])
@pytest.mark.parametrize("cache", [{}, {"num_host_blocks": 0}])
def test_swap_preemption_needs_a_host_tier(mode: str, cache: dict) -> None:
    fragment = f"preemption_mode='{mode}' .* no host tier .* set num_host_blocks / host_kv_cache_memory / swap_space"
    with pytest.raises(ConfigError, match=fragment):
        EngineConfig(cache=CacheConfig(**cache), scheduling=SchedulingConfig(preemption_mode=mode))
    with pytest.raises(ConfigError, match=fragment):
        EngineArgs(preemption_mode=mode, **cache)
    for tier in ({"num_host_blocks": 4}, {"host_kv_cache_memory": 1 << 20}, {"swap_space": 0.5}):
        EngineConfig(cache=CacheConfig(**tier), scheduling=SchedulingConfig(preemption_mode=mode))


def test_host_tier_defaults_and_has_host_tier(tmp_path) -> None:
    config = CacheConfig()
    assert (config.num_host_blocks, config.host_kv_cache_memory, config.swap_space) == (None, None, None)
    assert (config.kv_cache_dir, config.kv_cache_dir_max_bytes) == (None, None)
    assert SchedulingConfig().preemption_mode == "recompute"
    assert not config.has_host_tier and not CacheConfig(num_host_blocks=0).has_host_tier
    assert CacheConfig(num_host_blocks=1).has_host_tier and CacheConfig(swap_space=4).has_host_tier
    assert CacheConfig(kv_cache_dir=tmp_path, num_host_blocks=4).kv_cache_dir == str(tmp_path)  # PathLike -> str


def test_engine_args_pass_the_host_tier_through(tmp_path) -> None:
    args = EngineArgs(
        num_host_blocks=64,
        preemption_mode="auto",
        kv_cache_dir=tmp_path / "kv",
        kv_cache_dir_max_bytes=1 << 30,
    )
    assert args.kv_cache_dir == str(tmp_path / "kv")
    config = args.create_engine_config()
    assert (config.cache.num_host_blocks, config.scheduling.preemption_mode) == (64, "auto")
    assert (config.cache.kv_cache_dir, config.cache.kv_cache_dir_max_bytes) == (str(tmp_path / "kv"), 1 << 30)
    config = EngineArgs(host_kv_cache_memory=1 << 20, preemption_mode="swap").create_engine_config()
    assert (config.cache.host_kv_cache_memory, config.cache.num_host_blocks) == (1 << 20, None)
    assert EngineArgs(swap_space=2.5).create_engine_config().cache.swap_space == 2.5
    assert not os.path.exists(tmp_path / "kv")  # created by the runner, not by the configuration


# ---------------------------------------------------------------- a tiny model: sizes and limits


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_qwen2_host")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


TINY_BLOCK = 8
TINY_BYTES_PER_BLOCK = 2 * 2 * TINY_BLOCK * 2 * 16 * 4  # K and V x 2 layers x 8 tokens x 2 heads x 16 x fp32


def _tiny(model: str, **cache) -> ModelRunner:
    cache.setdefault("num_blocks", 16)
    return ModelRunner(ModelConfig(model, dtype="float32", device="cpu"), CacheConfig(block_size=TINY_BLOCK, **cache))


@pytest.mark.parametrize(
    "cache",
    [
        {"num_host_blocks": 5},
        {"host_kv_cache_memory": 5 * TINY_BYTES_PER_BLOCK + 100},
        {"swap_space": 5 * TINY_BYTES_PER_BLOCK / 2**30},
    ],
)
def test_host_block_count_from_each_size_form(tiny_model: str, cache: dict) -> None:
    runner = _tiny(tiny_model, **cache)
    assert runner.bytes_per_block == TINY_BYTES_PER_BLOCK
    assert runner.num_host_blocks == 5 and runner.host_kv_cache_bytes == 5 * TINY_BYTES_PER_BLOCK
    assert runner.host_kv_cache is not None and runner.host_kv_cache.device.type == "cpu"
    assert runner.host_kv_cache.shape == (2, 2, 5, TINY_BLOCK, 2, 16)
    assert runner.host_kv_cache.dtype == runner.kv_cache.dtype and runner.host_kv_scale_cache is None
    assert not runner.host_kv_cache.is_pinned()  # pinned only for a CUDA device
    assert not runner.host_kv_cache.any()


def test_no_host_tier(tiny_model: str) -> None:
    for cache in ({}, {"num_host_blocks": 0}):
        runner = _tiny(tiny_model, **cache)
        assert (runner.num_host_blocks, runner.host_kv_cache_bytes) == (0, 0)
        assert runner.host_kv_cache is None and runner.host_kv_scale_cache is None and runner.host_cache is None
    runner.swap_blocks(None, np.zeros((0, 2), np.int32))  # nothing to do: fine
    with pytest.raises(InvalidArgumentError, match="swap_out holds 1 swap.* no host KV tier .* set num_host_blocks"):
        runner.swap_blocks(np.array([[0, 0]], np.int32))
    with pytest.raises(InvalidArgumentError, match="swap_in holds 2 swap.* no host KV tier"):
        runner.swap_blocks(swap_in=np.array([[0, 0], [1, 1]], np.int32))


def test_a_host_budget_below_one_block_is_refused(tiny_model: str) -> None:
    with pytest.raises(
        ConfigError, match="host_kv_cache_memory=4000 = 4,000 bytes is less than one KV block \\(4,096 bytes\\)"
    ):
        _tiny(tiny_model, host_kv_cache_memory=4000)
    with pytest.raises(ConfigError, match=r"swap_space=1e-06 GiB = 1,073 bytes is less than one KV block"):
        _tiny(tiny_model, swap_space=1e-6)


def test_swap_preemption_without_a_host_tier_is_refused_by_the_runner(tiny_model: str) -> None:
    with pytest.raises(ConfigError, match="preemption_mode='swap' .* no host tier"):
        ModelRunner(
            ModelConfig(tiny_model, device="cpu"),
            CacheConfig(block_size=TINY_BLOCK, num_blocks=16),
            SchedulingConfig(preemption_mode="swap"),
        )


def test_a_host_pool_larger_than_memory_is_refused_before_allocation(tiny_model: str, monkeypatch) -> None:
    import pagedkv.worker.kv_cache_plan as kv_cache_plan

    # On a CPU device the host tier sits beside the device pool (16 blocks = 65,536 bytes).
    monkeypatch.setattr(kv_cache_plan, "_available_memory", lambda device: 100_000)
    with pytest.raises(
        ConfigError,
        match=r"the host KV cache would take 40,960 bytes \(10 host blocks x 4,096 bytes\), more than the "
        r"34,464 bytes of host memory available beside the device KV cache: lower num_host_blocks",
    ):
        _tiny(tiny_model, num_host_blocks=10)
    assert _tiny(tiny_model, num_host_blocks=8).num_host_blocks == 8


def test_a_host_budget_past_max_num_blocks_is_clamped(tiny_model: str, monkeypatch) -> None:
    import pagedkv.worker.kv_cache_plan as kv_cache_plan

    monkeypatch.setattr(kv_cache_plan, "MAX_NUM_BLOCKS", 64)
    with pytest.warns(UserWarning, match=r"makes room for 256 blocks .* host tier is clamped to 64 blocks"):
        runner = _tiny(tiny_model, host_kv_cache_memory=256 * TINY_BYTES_PER_BLOCK)
    assert runner.num_host_blocks == 64 and runner.host_kv_cache is not None
    assert runner.host_kv_cache.shape[2] == 64


def test_kv_cache_dir_is_created_and_must_be_writable(tiny_model: str, tmp_path) -> None:
    folder = tmp_path / "a" / "b"
    assert _tiny(tiny_model, kv_cache_dir=folder, num_host_blocks=4).kv_cache_dir == str(folder)
    assert folder.is_dir()
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match="kv_cache_dir=.*file' cannot be created"):
        _tiny(tiny_model, kv_cache_dir=a_file, num_host_blocks=4)
    with pytest.raises(ConfigError, match="kv_cache_dir=.*cannot be created"):
        _tiny(tiny_model, kv_cache_dir=a_file / "below", num_host_blocks=4)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_an_unwritable_kv_cache_dir_is_refused(tiny_model: str, tmp_path) -> None:
    folder = tmp_path / "read_only"
    folder.mkdir()
    os.chmod(folder, 0o500)
    try:
        with pytest.raises(ConfigError, match="kv_cache_dir=.*read_only' is not writable"):
            _tiny(tiny_model, kv_cache_dir=folder, num_host_blocks=4)
    finally:
        os.chmod(folder, 0o700)


# ---------------------------------------------------------------- swaps on the runner's tensors


@pytest.fixture(scope="module")
def smol_f32() -> ModelRunner:
    return ModelRunner(
        ModelConfig(None, dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=16, num_host_blocks=8),
    )


@pytest.fixture(scope="module")
def smol_int8() -> ModelRunner:
    bytes_per_block = 2 * 30 * BLOCK_SIZE * 3 * (64 + 2)  # int8 data + a bfloat16 scale per vector
    return ModelRunner(
        ModelConfig(None, dtype="float32", device="cpu"),
        CacheConfig(
            block_size=BLOCK_SIZE, num_blocks=16, kv_cache_dtype="int8", host_kv_cache_memory=8 * bytes_per_block + 7
        ),
    )


@pytest.fixture(scope="module")
def tiny_fp8(tiny_model: str) -> ModelRunner:
    return _tiny(tiny_model, kv_cache_dtype="fp8_e4m3", swap_space=8 * 2 * 2 * TINY_BLOCK * 2 * (16 + 2) / 2**30)


@pytest.fixture(params=["smol_f32", "smol_int8", "tiny_fp8"])
def runner(request) -> ModelRunner:
    return request.getfixturevalue(request.param)


def _tensors(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(device, host) pairs of the runner: the data, and the scales of a quantized cache."""
    assert runner.host_kv_cache is not None
    pairs = [(runner.kv_cache, runner.host_kv_cache)]
    if runner.kv_scale_cache is not None:
        assert runner.host_kv_scale_cache is not None
        pairs.append((runner.kv_scale_cache, runner.host_kv_scale_cache))
    return pairs


def _fill(runner: ModelRunner, blocks: list[int], seed: int) -> list[torch.Tensor]:
    """Random content in device ``blocks`` (data and scales); returns it per tensor."""
    generator = torch.Generator().manual_seed(seed)
    written = []
    with torch.inference_mode():
        for device_t, _ in _tensors(runner):
            shape = (*device_t.shape[:2], len(blocks), *device_t.shape[3:])
            values = torch.randn(shape, generator=generator) * (40.0 if device_t.dtype == torch.int8 else 1.0)
            values = values.clamp(-127, 127).to(device_t.dtype)
            device_t[:, :, blocks] = values.to(device_t.device)
            written.append(values)
    return written


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return byte_view(tensor.clone())


def _snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [_bits(t) for pair in _tensors(runner) for t in pair]


def _assert_blocks(tensor: torch.Tensor, blocks: list[int], expected: torch.Tensor) -> None:
    assert torch.equal(_bits(tensor[:, :, blocks]), _bits(expected))


def test_swap_round_trip_is_bit_exact(runner: ModelRunner) -> None:
    assert runner.num_host_blocks == 8 and (runner.kv_scale_cache is None) == (runner.kv_format is None)
    if runner.kv_format is not None:
        assert runner.host_kv_scale_cache is not None
        assert runner.host_kv_scale_cache.shape == (
            *runner.kv_scale_cache.shape[:2],
            8,
            *runner.kv_scale_cache.shape[3:],
        )
        assert runner.host_kv_scale_cache.dtype == torch.bfloat16
    assert runner.host_kv_cache_bytes == 8 * runner.bytes_per_block == sum(h.nbytes for _, h in _tensors(runner))
    content = _fill(runner, [3, 5, 6], seed=1)
    others = _snapshot(runner)
    runner.swap_blocks(swap_out=np.array([[3, 7], [5, 0], [6, 2]], dtype=np.int32))
    for (device_t, host_t), expected, before_device, before_host in zip(
        _tensors(runner), content, others[0::2], others[1::2]
    ):
        _assert_blocks(host_t, [7, 0, 2], expected)
        assert torch.equal(_bits(device_t), before_device)  # swap_out leaves the device blocks as they were
        untouched = [1, 3, 4, 5, 6]
        assert torch.equal(_bits(host_t[:, :, untouched]), before_host[:, :, untouched])
    _fill(runner, [3, 5, 6], seed=2)  # the device blocks are reused by someone else
    before = _snapshot(runner)
    runner.swap_blocks(swap_in=np.array([[7, 10], [0, 1], [2, 14]], dtype=np.int64))
    for (device_t, host_t), expected, before_device, before_host in zip(
        _tensors(runner), content, before[0::2], before[1::2]
    ):
        _assert_blocks(device_t, [10, 1, 14], expected)
        untouched = [b for b in range(runner.num_blocks) if b not in (10, 1, 14)]
        assert torch.equal(_bits(device_t[:, :, untouched]), before_device[:, :, untouched])
        assert torch.equal(_bits(host_t), before_host)  # swap_in leaves the host blocks as they were


def test_swap_out_reads_a_block_before_swap_in_overwrites_it(runner: ModelRunner) -> None:
    old = _fill(runner, [4], seed=3)  # device block 4: about to leave, and be refilled
    parked = _fill(runner, [8], seed=4)
    runner.swap_blocks(swap_out=np.array([[8, 1]], dtype=np.int32))  # host block 1: parked content
    moving = _fill(runner, [9], seed=5)
    runner.swap_blocks(
        swap_out=np.array([[4, 3], [9, 6]], dtype=np.int32),
        swap_in=np.array([[1, 4], [6, 11]], dtype=np.int32),  # host 6 is written by this step's swap_out
    )
    for (device_t, host_t), was_4, was_8, was_9 in zip(_tensors(runner), old, parked, moving):
        _assert_blocks(host_t, [3], was_4)  # swap_out read block 4 first ...
        _assert_blocks(device_t, [4], was_8)  # ... then swap_in overwrote it
        _assert_blocks(device_t, [11], was_9)  # swap_out runs before swap_in: host 6 already holds block 9


@pytest.mark.parametrize(
    ("swap_out", "swap_in", "fragment"),
    [
        ([[16, 0]], None, r"swap_out holds device block id 16, not in \[0, 16\)"),
        ([[-1, 0]], None, r"swap_out holds device block id -1"),
        ([[0, 8]], None, r"swap_out holds host block id 8, not in \[0, 8\)"),
        (None, [[8, 0]], r"swap_in holds host block id 8, not in \[0, 8\)"),
        (None, [[0, 16]], r"swap_in holds device block id 16, not in \[0, 16\)"),
        (None, [[0, -3]], r"swap_in holds device block id -3"),
        ([[0, 1], [2, 1]], None, "swap_out writes the same host block twice"),
        (None, [[0, 5], [1, 5]], "swap_in writes the same device block twice"),
        ([[0, 1, 2]], None, r"swap_out must be \[K, 2\] \(device block, host block\), got shape \(1, 3\)"),
        (None, [0, 1], r"swap_in must be \[K, 2\] \(host block, device block\), got shape \(2,\)"),
        (None, np.array([[0.0, 1.0]]), "swap_in must hold integers"),
        # A good swap_out is not run when swap_in is bad.
        ([[0, 1]], [[0, 99]], "swap_in holds device block id 99"),
    ],
)
def test_bad_swaps_raise_and_change_nothing(smol_int8: ModelRunner, swap_out, swap_in, fragment: str) -> None:
    runner = smol_int8
    _fill(runner, list(range(runner.num_blocks)), seed=6)
    before = _snapshot(runner)
    arrays = [None if ops is None else np.asarray(ops) for ops in (swap_out, swap_in)]
    with pytest.raises(InvalidArgumentError, match=fragment):
        runner.swap_blocks(*arrays)
    for now, then in zip(_snapshot(runner), before):
        assert torch.equal(now, then)


def test_measure_swap_bandwidth_is_positive_and_leaves_the_kv_alone(smol_int8: ModelRunner) -> None:
    before = _snapshot(smol_int8)
    bandwidth = smol_int8.measure_swap_bandwidth(num_blocks=4, repeats=2)
    assert isinstance(bandwidth, float) and math.isfinite(bandwidth) and bandwidth > 0
    for now, then in zip(_snapshot(smol_int8), before):
        assert torch.equal(now, then)
    with pytest.raises(InvalidArgumentError, match="num_blocks must be a positive int, got 0"):
        smol_int8.measure_swap_bandwidth(num_blocks=0)


# ---------------------------------------------------------------- swaps in a step


def _step(tokens: list[int], blocks: list[int], start: int, end: int, **fields) -> StepInput:
    """One sequence's tokens ``start:end`` over ``blocks``, sampling the last one (the fields
    of a ``SchedulerOutput``; no swaps or copies unless given)."""
    empty = np.zeros((0, 2), dtype=np.int32)
    step = StepInput(
        input_ids=np.array(tokens[start:end], dtype=np.int64),
        positions=np.arange(start, end, dtype=np.int64),
        cu_seqlens_q=np.array([0, end - start], dtype=np.int32),
        seq_lens=np.array([end], dtype=np.int32),
        block_tables=np.array([blocks], dtype=np.int32),
        slot_mapping=np.array(
            [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)],
            dtype=np.int64,
        ),
        logits_indices=np.array([end - start - 1], dtype=np.int64),
        copy_ops=empty,
        swap_out=empty,
        swap_in=empty,
    )
    for name, value in fields.items():
        setattr(step, name, np.array(value, dtype=np.int32).reshape(-1, 2))
    return step


@pytest.mark.parametrize("name", ["smol_f32", "smol_int8"])
def test_a_sequence_swapped_out_and_back_in_decodes_the_same(request, name: str) -> None:
    runner: ModelRunner = request.getfixturevalue(name)
    tokens = [1] + np.random.default_rng(0).integers(100, 10_000, size=36).tolist()  # 37: 3 blocks, last partial
    first = [0, 1, 2]
    logits = runner.execute(_step(tokens, first, 0, len(tokens)))
    tokens.append(int(logits.argmax()))
    expected = runner.execute(_step(tokens, first, len(tokens) - 1, len(tokens)))

    runner.swap_blocks(swap_out=[[0, 5], [1, 6], [2, 7]])  # preempted: its KV goes to the host ...
    _fill(runner, first, seed=7)  # ... and its device blocks to another request
    # Resumed in other device blocks, in another order; the same decode again.
    second = [9, 4, 11]
    step = _step(tokens, second, len(tokens) - 1, len(tokens), swap_in=[[5, 9], [6, 4], [7, 11]])
    assert torch.equal(runner.execute(step), expected)


def test_a_bad_step_runs_no_swap(smol_f32: ModelRunner) -> None:
    runner = smol_f32
    tokens = list(range(100, 120))
    _fill(runner, list(range(runner.num_blocks)), seed=8)
    before = _snapshot(runner)
    cases = [
        (dict(swap_out=[[0, 3]], copy_ops=[[1, 16]]), "copy_ops holds block id 16"),
        (dict(swap_out=[[0, 3]], swap_in=[[9, 2]]), "swap_in holds host block id 9"),
        (dict(copy_ops=[[1, 2]], swap_in=[[3, 2], [4, 2]]), "swap_in writes the same device block twice"),
    ]
    for fields, fragment in cases:
        with pytest.raises(InvalidArgumentError, match=fragment):
            runner.execute(_step(tokens, [0, 1], 0, len(tokens), **fields))
        for now, then in zip(_snapshot(runner), before):
            assert torch.equal(now, then)
    # A step of swaps only: no tokens, no logits.
    empty = _step(tokens, [0], 0, 0, swap_out=[[0, 3]])
    empty.logits_indices = np.zeros(0, dtype=np.int64)
    assert runner.execute(empty).shape == (0, runner.vocab_size)
    assert torch.equal(_bits(runner.host_kv_cache[:, :, 3]), _bits(runner.kv_cache[:, :, 0]))


# ---------------------------------------------------------------- CUDA: the side-stream path


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cuda_swaps_round_trip(tiny_model: str, kv_cache_dtype: str) -> None:
    runner = ModelRunner(
        ModelConfig(tiny_model, dtype="bfloat16", device="cuda"),
        CacheConfig(block_size=TINY_BLOCK, num_blocks=32, num_host_blocks=8, kv_cache_dtype=kv_cache_dtype),
    )
    assert runner.host_kv_cache is not None and runner.host_kv_cache.is_pinned()
    content = [t.cpu() for t in _fill(runner, [3, 5], seed=9)]
    runner.swap_blocks(swap_out=[[3, 7], [5, 0]])
    for (_, host_t), expected in zip(_tensors(runner), content):
        _assert_blocks(host_t, [7, 0], expected)
    other = [t.cpu() for t in _fill(runner, [3], seed=10)]
    # Block 3 leaves (to host 2) and is refilled from host 0 in one call; host 7 -> block 20.
    runner.swap_blocks(swap_out=[[3, 2]], swap_in=[[0, 3], [7, 20]])
    for (device_t, host_t), was, now in zip(_tensors(runner), content, other):
        _assert_blocks(host_t, [2], now)
        _assert_blocks(device_t.cpu(), [3, 20], was[:, :, [1, 0]])
    bandwidth = runner.measure_swap_bandwidth()
    assert math.isfinite(bandwidth) and bandwidth > 0
