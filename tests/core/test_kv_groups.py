"""pagedkv.sim.kv_groups: the KV a model with window / chunk layers holds, by hand, and the study."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedkv import ConfigError, InvalidTypeError, Scheduler, SchedulerConfig
from pagedkv.sim.kv_groups import (
    AttentionGroup,
    ModelKV,
    blocks_held,
    bytes_per_page,
    bytes_per_sequence,
    kv_group_spans,
    model_kv_of_config,
    page_layers,
)

REPO = Path(__file__).resolve().parents[2]


def test_blocks_held_by_each_kind_of_group() -> None:
    # Next token at position 20, blocks of 4: full attention holds blocks 0..5.
    assert blocks_held(AttentionGroup(1), 20, 4) == 6
    # A window of 5 sees 16..20: blocks 4 and 5. A window of 6 sees 15..20: blocks 3..5.
    assert blocks_held(AttentionGroup(1, sliding_window=5), 20, 4) == 2
    assert blocks_held(AttentionGroup(1, sliding_window=6), 20, 4) == 3
    # A chunk of 8: position 20 sees 16..20 (blocks 4, 5); position 16 opens a chunk: one block.
    assert blocks_held(AttentionGroup(1, chunk_size=8), 20, 4) == 2
    assert blocks_held(AttentionGroup(1, chunk_size=8), 16, 4) == 1
    # Early on, a window holds what full attention holds.
    assert blocks_held(AttentionGroup(1, sliding_window=64), 20, 4) == 6


def test_the_three_layouts_by_hand() -> None:
    # 2 full layers and 3 sliding layers (window 5); one layer stores 8 bytes per token.
    model = ModelKV("toy", (AttentionGroup(2), AttentionGroup(3, sliding_window=5)), num_kv_heads=1, head_dim=2)
    layer_block = 8 * 4  # blocks of 4 tokens
    assert bytes_per_sequence(model, 20, "whole", 4) == 5 * 6 * layer_block
    assert bytes_per_sequence(model, 20, "groups", 4) == (2 * 6 + 3 * 2) * layer_block
    # vLLM's rule: pages of 2 layers; the sliding group becomes two groups of 2, one padded.
    assert bytes_per_sequence(model, 20, "vllm", 4) == (2 * 6 + 4 * 2) * layer_block
    assert (page_layers(model, "groups"), page_layers(model, "vllm"), page_layers(model, "whole")) == (1, 2, 5)
    with pytest.raises(ValueError):
        bytes_per_sequence(model, 20, "contiguous", 4)


def test_configs_become_groups() -> None:
    gemma = model_kv_of_config(
        "gemma",
        {
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "sliding_window": 512,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        },
    )
    assert [(g.num_layers, g.kind) for g in gemma.groups] == [(3, "sliding 512"), (1, "full")]
    assert gemma.bytes_per_layer_token == 2 * 256 * 2
    mistral = model_kv_of_config(
        "mistral",
        {
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "sliding_window": 8,
        },
    )
    assert [(g.num_layers, g.kind) for g in mistral.groups] == [(2, "sliding 8")] and mistral.head_dim == 16
    qwen = model_kv_of_config(
        "qwen",
        {
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "sliding_window": 8,
            "use_sliding_window": False,
        },
    )
    assert [g.kind for g in qwen.groups] == ["full"]
    with pytest.raises(ValueError, match="layer_types"):
        model_kv_of_config(
            "bad", {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 8, "layer_types": ["full_attention"]}
        )
    with pytest.raises(ValueError, match="unknown layer type"):
        model_kv_of_config(
            "bad", {"num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 8, "layer_types": ["mamba"]}
        )


def _run_bench(script: str) -> str:
    """A bench script's printed output (it must succeed)."""
    return subprocess.run(
        [sys.executable, str(REPO / "benches" / script)], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def test_the_study_prints_its_table_and_meets_its_targets() -> None:
    out = _run_bench("study_kv_groups.py")
    assert out.count("| google/gemma-3-27b-it |") == 3 and "NOT met" not in out
    assert out.count(": met.") == 2


def test_kv_group_spans_of_a_config() -> None:
    gemma = model_kv_of_config(
        "gemma",
        {
            "num_hidden_layers": 6,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "sliding_window": 4,
            "layer_types": ["sliding_attention"] * 2
            + ["full_attention"]
            + ["sliding_attention"] * 2
            + ["full_attention"],
        },
    )
    # gcd(4, 2) = 2 layers a page: the 2 full layers take one column, the 4 sliding ones two.
    assert kv_group_spans(gemma) == (("full", None), ("sliding_window", 4), ("sliding_window", 4))
    assert kv_group_spans(gemma, "whole") == (("full", None),)
    assert bytes_per_page(gemma, "groups", 16) == 2 * (2 * 8 * 2) * 16
    with pytest.raises(ValueError, match="whole' or 'groups"):
        kv_group_spans(gemma, "vllm")


def test_the_core_takes_columns_and_gives_back_blocks_behind_the_window() -> None:
    """The bindings: a scheduler with a full and a sliding column returns both columns' tables
    (given-back entries -1) and slots; bad spans are refused before anything runs."""
    config = SchedulerConfig(
        num_blocks=64, block_size=4, max_model_len=64, attention_spans=[("full", None), ("sliding_window", 6)]
    )
    assert config.attention_spans == [("full", None), ("sliding_window", 6)]
    sched = Scheduler(config)
    sched.add_request("a", list(range(10)), max_tokens=20)
    out = sched.schedule()
    assert out.num_kv_groups == 2
    assert out.block_tables.shape == (2, 3) and out.slot_mapping.shape == (20,)
    tables = out.block_tables.reshape(2, 1, -1)
    assert set(tables[0, 0]).isdisjoint(tables[1, 0]), "the columns hold different pages"
    for _ in range(8):
        sched.update(out, np.array([7], dtype=np.int64))
        out = sched.schedule()
    # The query at 17 sees 12..17: blocks 0..2 of the sliding column are given back.
    tables = out.block_tables.reshape(2, 1, -1)
    assert (tables[0, 0] >= 0).all()
    assert list(tables[1, 0][:3]) == [-1, -1, -1] and (tables[1, 0][3:] >= 0).all()
    assert sched.stats().num_free_blocks == 64 - 5 - 2
    for bad, error in (
        ([], ConfigError),
        ([("sliding_window", None)], ConfigError),
        ([("sliding_window", 0)], ConfigError),
        ([("ring", 4)], ConfigError),
        (["full"], InvalidTypeError),
    ):
        with pytest.raises(error):
            SchedulerConfig(num_blocks=8, attention_spans=bad)


def test_the_replay_study_meets_the_peak_kv_target() -> None:
    out = _run_bench("study_kv_groups_replay.py")
    assert "meets the target" in out
    # The tight pool: every layer whole preempts, the groups do not.
    tight = [line for line in out.splitlines() if line.startswith("| tight")]
    assert "| 0 |" not in tight[0] and "| 0 |" in tight[1]


def test_kv_layout_of_layers() -> None:
    """The runner's layout: pages of gcd(group sizes) layers, full columns first, each layer's
    page slot and column (worker/kv_layout.py)."""
    from pagedkv.kernels.layer_attention import LayerAttention
    from pagedkv.worker.kv_layout import KVLayout

    full, sliding, chunked = LayerAttention(), LayerAttention(sliding_window=512), LayerAttention(chunk_size=64)
    gemma = [sliding] * 5 + [full] + [sliding] * 5 + [full] + [sliding] * 5 + [full]
    layout = KVLayout.of_layers(gemma, max_model_len=4096)
    assert isinstance(layout, KVLayout) and layout.grouped
    assert layout.page_layers == 3
    assert layout.kv_groups == (("full", None),) + (("sliding_window", 512),) * 5
    assert layout.describe() == "1 full + 5 sliding window 512 KV cache groups, pages of 3 layers"
    # The full layers (5, 11, 17) fill column 0's page; the sliding ones three to a column.
    assert [layout.layer_kv_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [layout.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert layout.layer_kv_group[:5] == (1, 1, 1, 2, 2) and layout.layer_slot[:5] == (0, 1, 2, 0, 1)
    assert sorted(zip(layout.layer_kv_group, layout.layer_slot)) == sorted(
        {*zip(layout.layer_kv_group, layout.layer_slot)}
    )
    # A window at least max_model_len long limits nothing: every layer whole.
    assert not KVLayout.of_layers(gemma, max_model_len=512).grouped  # type: ignore[union-attr]
    # Every layer sliding (Mistral): one sliding column, pages of every layer.
    mistral = KVLayout.of_layers([sliding] * 4, max_model_len=4096)
    assert (
        isinstance(mistral, KVLayout) and mistral.kv_groups == (("sliding_window", 512),) and mistral.page_layers == 4
    )
    llama4 = KVLayout.of_layers([chunked] * 3 + [full], max_model_len=4096)
    assert isinstance(llama4, KVLayout) and llama4.kv_groups == (("full", None),) + (("chunked_local", 64),) * 3
    assert KVLayout.of_layers([LayerAttention(sliding_window=8, chunk_size=64), full], 4096) == (
        "a layer with both a sliding window and chunks"
    )
    assert KVLayout.whole(4).kv_groups == (("full", None),) and not KVLayout.whole(4).grouped
