"""pagedkv.sim.kv_groups: the KV a model with window / chunk layers holds, by hand, and the study."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.sim.kv_groups import (
    AttentionGroup,
    ModelKV,
    blocks_held,
    bytes_per_sequence,
    model_kv_of_config,
    page_layers,
)

REPO = Path(__file__).resolve().parents[1]


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


def test_the_study_prints_its_table_and_meets_its_targets() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "benches" / "study_kv_groups.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out.count("| google/gemma-3-27b-it |") == 3 and "NOT met" not in out
    assert out.count(": met.") == 2
