"""A tiny random-weight checkpoint for tests about the engine rather than the model.

The scheduler, the KV cache, its tiers and transfers behave the same whatever the weights; a
two-layer model runs their tests in a fraction of the embedded SmolLM2's time. Its vocabulary is
the embedded tokenizer's (49,152 ids), whose files are copied into the folder: the folder is a
whole model for ``--model`` (``pagedkv serve``, ``generate``, ``demo``, the router's tokenizer);
engine tests may also pass ``tokenizer=default_model_dir()``, the same tokenizer. Greedy
comparisons need an argmax that two correct implementations agree on: random logits are nearly
flat, so the (tied) embeddings are scaled up until the best token stands clear of the next.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 49152  # the embedded SmolLM2 tokenizer's
# The embedded model's tokenizer (and its chat template), copied beside the tiny weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_seeded(config: object, folder: Path, *, embedding_scale: float) -> None:
    """Writes a random model of ``config`` to ``folder``: seeded (the same weights every time,
    the global RNG left as it was), its input embeddings scaled by ``embedding_scale`` so that
    greedy argmax has no near-ties (random logits are nearly flat)."""
    from transformers import AutoModelForCausalLM

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embedding_scale)
    model.save_pretrained(folder)


def save_tiny_qwen2(folder: Path, *, hidden_size: int = 128, max_position_embeddings: int = 512) -> Path:
    """Writes a random Qwen2 (2 layers, 2 heads, 1 KV head, tied embeddings) and the embedded
    tokenizer to ``folder``, the same weights for the same arguments (seeded)."""
    import shutil

    from transformers import Qwen2Config

    from pagedkv.worker.model_files import default_model_dir

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
    )
    save_seeded(config, folder, embedding_scale=40.0)
    tokenizer = default_model_dir()
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    return folder


def save_tiny_windowed(folder: Path) -> str:
    """Writes a random gemma3_text model with KV cache groups to ``folder``: four layers
    alternating a 12-token sliding window and full attention (one full and one sliding column,
    pages of two layers), a 512-token vocabulary (pass ``tokenizer=default_model_dir()`` and
    prompt token ids below 512). Returns the folder as a string."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma3_text",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=12,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=16,
    )
    save_seeded(config, folder, embedding_scale=8.0)
    return str(folder)
