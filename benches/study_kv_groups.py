"""KV cache groups: sequences and tokens held per GiB of KV, groups vs every layer whole.

For the published configs in ``benches/studies/configs/attention_types.json`` (the fields that
decide the KV shape, copied from each model's config.json; nothing is downloaded), at 8k, 32k
and 128k contexts, bfloat16 KV, blocks of 16 tokens, three layouts (``pagedkv.sim.kv_groups``):

* whole: every layer keeps the whole history (what a cache without groups holds);
* groups: pagedkv's layout (pages of gcd(group sizes) layers, no padding);
* vllm: vLLM's hybrid allocator rule (pages of the smallest group's layer count, the other
  groups split into groups of that size, the last padded).

    python benches/study_kv_groups.py            # print the table
    python benches/study_kv_groups.py --write    # and record it in benches/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import add_write_flag, write_section  # noqa: E402

from pagedkv.sim.kv_groups import bytes_per_sequence, model_kv_of_config, page_layers  # noqa: E402

CONFIGS = HERE / "studies" / "configs" / "attention_types.json"
CONTEXTS = (8192, 32768, 131072)
BLOCK_SIZE = 16
GIB = 1 << 30
# The targets: sequences per GiB with groups over every layer whole, at 32k.
TARGETS = {"google/gemma-3-27b-it": 5.0, "openai/gpt-oss-120b": 1.9}


def rows() -> list[dict]:
    out = []
    for name, config in json.loads(CONFIGS.read_text()).items():
        model = model_kv_of_config(name, config)
        for context in CONTEXTS:
            per_seq = {
                layout: bytes_per_sequence(model, context, layout, BLOCK_SIZE) for layout in ("whole", "groups", "vllm")
            }
            out.append(
                {
                    "model": name,
                    "groups": " + ".join(f"{g.num_layers} {g.kind}" for g in model.groups),
                    "page_layers": (page_layers(model, "groups"), page_layers(model, "vllm")),
                    "context": context,
                    "trained": context <= config.get("max_position_embeddings", context),
                    **{f"seqs_{k}": GIB / v for k, v in per_seq.items()},
                    **{f"tokens_{k}": GIB / v * context for k, v in per_seq.items()},
                    "ratio": per_seq["whole"] / per_seq["groups"],
                    "vs_vllm": per_seq["vllm"] / per_seq["groups"],
                }
            )
    return out


def table(found: list[dict]) -> str:
    lines = [
        "| model | layers | context | seqs/GiB whole | seqs/GiB groups | seqs/GiB vLLM rule | tokens/GiB whole | tokens/GiB groups | groups / whole | groups / vLLM rule |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        lines.append(
            f"| {r['model']} | {r['groups']} | {r['context'] // 1024}k{'' if r['trained'] else ' *'} | {r['seqs_whole']:.3f} | {r['seqs_groups']:.3f} | "
            f"{r['seqs_vllm']:.3f} | {r['tokens_whole']:,.0f} | {r['tokens_groups']:,.0f} | **{r['ratio']:.2f}x** | {r['vs_vllm']:.3f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_write_flag(parser)
    args = parser.parse_args()
    found = rows()
    body = [
        f"bfloat16 KV, blocks of {BLOCK_SIZE} tokens; a sequence's blocks include its next token's. "
        "Page sizes: groups = gcd of the group sizes (no padding), vLLM rule = the smallest group.",
        "",
        table(found),
        "",
        "\\* beyond the context the model was trained for (Gemma 2: 8k): the arithmetic only. At exactly "
        "8k, Llama 4's next token opens a new 8192-token chunk, so its chunked layers hold one block.",
        "",
    ]
    for name, target in TARGETS.items():
        ratio = next(r["ratio"] for r in found if r["model"] == name and r["context"] == 32768)
        body.append(
            f"- {name} at 32k: {ratio:.2f}x the sequences per GiB of every layer whole (target >= {target}x): {'met' if ratio >= target else 'NOT met'}."
        )
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        write_section(
            "kv_groups_capacity",
            "python benches/study_kv_groups.py --write",
            text,
            heading="## KV cache groups: capacity (issue 25)",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
