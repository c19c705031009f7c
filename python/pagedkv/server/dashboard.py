"""The live KV-cache page: ``GET /dashboard`` (a self-contained HTML page shipped in the
package, ``static/dashboard.html``) and ``GET /dashboard/state`` (what it draws, as JSON).

The state comes from one engine-thread call per refresh (``AsyncLLM.kv_snapshot``: the Rust
core's block maps and request summaries), so the step loop pays nothing while no page is open.
Block states travel as base64 byte arrays (one byte per block, 4 per owner, 2 per KV cache
group), not per-block JSON. With KV cache groups the page also draws the device blocks by
group (which group's layers each block holds) and counts each group's blocks. Prompt text is
left out unless the server was started with ``--dashboard-show-prompts``.
"""

from __future__ import annotations

import base64
import time
from importlib import resources
from typing import Any

import numpy as np

__all__ = ["BLOCK_STATES", "dashboard_html", "encode_state"]

# One byte per block.
FREE, FREE_CACHED, USED, SHARED = 0, 1, 2, 3
BLOCK_STATES = {FREE: "free", FREE_CACHED: "free, cached", USED: "in use", SHARED: "shared (ref count > 1)"}
_PROMPT_CHARS = 120


def block_states(ref_counts: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """uint8[N]: free, free-but-cached, in use, or shared, from a pool's ref counts and flags."""
    refs = np.asarray(ref_counts)
    states = np.where(refs > 1, SHARED, np.where(refs == 1, USED, np.where(np.asarray(cached), FREE_CACHED, FREE)))
    return states.astype(np.uint8)


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()


def encode_state(snapshot: dict[str, Any], *, show_prompts: bool) -> dict[str, Any]:
    """The JSON of ``/dashboard/state`` from ``LLMEngine.kv_snapshot()``."""
    stats = snapshot["stats"]
    device = block_states(snapshot["ref_counts"], snapshot["cached"])
    host = block_states(snapshot["host_ref_counts"], snapshot["host_cached"])
    disk = block_states(snapshot["disk_ref_counts"], snapshot["disk_cached"])
    prompts = snapshot["prompts"] if show_prompts else {}
    constraints = snapshot.get("constraints", {})
    drafts = snapshot.get("drafts", {})
    requests = [
        {
            "id": rid,
            "arrival": arrival,
            "state": state,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "blocks": num_blocks,
            "cached_tokens": cached_tokens,
            "samples": samples,
            # A structured request's constraint kind ("json", "regex", "grammar", ...), or "".
            "constraint": constraints.get(rid, ""),
            # Speculative decoding: [drafted, accepted] tokens so far ([0, 0] without drafts).
            "drafts": list(drafts.get(rid, (0, 0))),
            **({"prompt": (prompts.get(rid) or "")[:_PROMPT_CHARS]} if show_prompts else {}),
        }
        for rid, arrival, state, prompt_tokens, output_tokens, num_blocks, cached_tokens, samples in snapshot[
            "requests"
        ]
    ]
    keys = (
        "num_blocks",
        "num_used_blocks",
        "num_cached_blocks",
        "kv_usage",
        "kv_utilization",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "num_running",
        "num_waiting",
        "generation_tokens",
        "kv_cache_dtype",
        "kv_bytes_per_token",
        "num_host_blocks",
        "num_disk_blocks",
        "num_disk_cached_blocks",
        "num_spec_draft_tokens",
        "num_spec_accepted_tokens",
    )
    return {
        "time": time.time(),
        "block_states": _b64(device),
        "block_owners": _b64(np.asarray(snapshot["owner"], dtype=np.int32)),
        # KV cache groups: the group each device block serves (-1: free, uncached).
        "block_kv_groups": _b64(np.asarray(snapshot["kv_groups"], dtype=np.int16)),
        "kv_group_spans": list(snapshot["kv_group_spans"]),
        "host_block_states": _b64(host),
        "disk_block_states": _b64(disk),
        "recent_preemptions": [{"time": t, "id": rid} for t, rid in snapshot["recent_preemptions"]],
        "state_names": BLOCK_STATES,
        "requests": requests,
        "stats": {k: stats.get(k) for k in keys},
        "show_prompts": show_prompts,
    }


def dashboard_html() -> str:
    return resources.files("pagedkv.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")
