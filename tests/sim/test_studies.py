"""The studies on tiny synthetic workloads: their numbers, and that every plot is a real PNG."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from studies import (  # noqa: E402
    block_size_study,
    breakdown_study,
    memory_map_study,
    parallel_sampling_study,
    prefix_cache_study,
    speed_study,
)
from studies.memory_map import record_memory_maps, render, render_host  # noqa: E402
from studies.offload import host_tier_prefix_study, retention_study, swap_study, tokens_needed  # noqa: E402
from studies.prefix_cache import (  # noqa: E402
    declared_prefix_hits,
    default_pool_sizes,
    unbounded_pool_blocks,
)

from pagedkv.sim.replay import PagedConfig  # noqa: E402
from pagedkv.sim.workloads import ArrivalProcess, TraceRequest, shared_prefix_requests  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_MODEL_LEN = 256


def _workload(num_requests: int = 40, seed: int = 0) -> list[TraceRequest]:
    return shared_prefix_requests(
        num_requests,
        num_prefixes=3,
        prefix_len=48,
        user_len=(4, 40),
        output_len=(4, 60),
        seed=seed,
        arrivals=ArrivalProcess(rate=25.0),
    )


def _check_outputs(result, out_dir: Path, pngs: list[str]) -> dict:
    files = result.write(out_dir)
    for name in pngs:
        path = out_dir / name
        assert path in files
        blob = path.read_bytes()
        assert blob[:8] == PNG_SIGNATURE
        assert len(blob) > 10_000  # a drawn figure, not an empty canvas
    data = json.loads((out_dir / f"{result.name}.json").read_text())
    markdown = (out_dir / f"{result.name}.md").read_text()
    for name in pngs:
        assert f"]({name})" in markdown
        assert f"](results/{name})" in result.markdown("results/")
    return data


def test_breakdown_study(tmp_path: Path) -> None:
    result = breakdown_study(_workload(), tmp_path, num_slots=1024, max_model_len=MAX_MODEL_LEN, workload_label="tiny")
    data = _check_outputs(result, tmp_path, ["memory_breakdown.png"])
    allocators = data["allocators"]
    assert list(allocators) == ["paged", "max_length", "exact"]
    for row in allocators.values():
        assert sum(row["fraction_of_pool"].values()) == pytest.approx(1.0)
        assert sum(row["fraction_of_held"].values()) == pytest.approx(1.0)
    paged = allocators["paged"]["fraction_of_held"]
    assert paged["reserved_unused"] == paged["external_fragmentation"] == 0
    assert paged["token_states"] == pytest.approx(allocators["paged"]["kv_utilization"])
    assert allocators["exact"]["fraction_of_held"]["internal_fragmentation"] == 0
    assert paged["token_states"] > allocators["max_length"]["fraction_of_held"]["token_states"]


def test_block_size_study(tmp_path: Path) -> None:
    workloads = {"a": _workload(), "b": _workload(seed=1)}
    result = block_size_study(workloads, tmp_path, num_slots=1024, block_sizes=(8, 16, 32), max_model_len=MAX_MODEL_LEN)
    data = _check_outputs(result, tmp_path, ["block_size.png"])
    rows = data["workloads"]["a"]["rows"]
    assert [r["block_size"] for r in rows] == [8, 16, 32]
    assert [r["num_blocks"] for r in rows] == [128, 64, 32]
    assert [r["table_bytes_per_token"] for r in rows] == [0.5, 0.25, 0.125]
    assert all(0 < r["kv_utilization"] <= 1 and r["steps"] > 0 for r in rows)


def test_parallel_sampling_study_matches_prediction(tmp_path: Path) -> None:
    # Arrivals far apart: every prompt is prefilled in one step, so the arithmetic is exact.
    requests = [dataclasses.replace(r, arrival_time=float(i)) for i, r in enumerate(_workload(12))]
    result = parallel_sampling_study(
        {"tiny": requests}, tmp_path, sample_counts=(2, 4), max_model_len=MAX_MODEL_LEN, max_num_seqs=16
    )
    data = _check_outputs(result, tmp_path, ["parallel_sampling.png"])
    workload = data["workloads"]["tiny"]
    for row in workload["rows"]:
        assert row["preemptions"] == 0
        assert row["forked_block_steps"] == row["predicted_forked_block_steps"]
        assert row["independent_block_steps"] == row["predicted_independent_block_steps"]
        assert 0 < row["saving_block_steps"] < workload["bound"]
    savings = [row["saving_block_steps"] for row in workload["rows"]]
    assert savings[0] < savings[1]  # more samples share more


def test_declared_prefix_hits_by_hand() -> None:
    def req(rid: str, prompt_len: int, prefix: str | None, shared: int) -> TraceRequest:
        return TraceRequest(rid, 0.0, np.arange(prompt_len), 1, shared_prefix_id=prefix, shared_prefix_len=shared)

    requests = [
        req("a", 40, "s", 35),  # first use of "s": nothing to hit
        req("b", 40, "s", 35),  # 35 shared -> 2 full blocks of 16
        req("c", 33, "s", 33),  # whole prompt shared, one token left to compute -> 32 -> 2 blocks
        req("d", 20, None, 0),
        req("e", 16, "s", 16),  # leaves a token: 15 -> 0 blocks
    ]
    assert declared_prefix_hits(requests, 16) == 32 + 32
    assert default_pool_sizes(256, 16, 100) == [16, 32, 64]


def test_prefix_cache_study(tmp_path: Path) -> None:
    requests = _workload(60)
    result = prefix_cache_study({"shared": requests}, tmp_path, pool_sizes=[16, 64, 256], max_model_len=MAX_MODEL_LEN)
    data = _check_outputs(result, tmp_path, ["prefix_cache.png"])
    workload = data["workloads"]["shared"]
    assert [r["num_blocks"] for r in workload["rows"]] == [16, 64, 256]
    assert workload["declared_hits"] == declared_prefix_hits(requests, 16)
    # Synthetic tokens share nothing by chance: a pool that never evicts hits exactly the declared prefixes.
    unbounded = workload["unbounded"]
    assert unbounded["num_blocks"] == unbounded_pool_blocks(requests, 16, MAX_MODEL_LEN)
    assert unbounded["prefill_tokens_saved"] == workload["declared_hits"]
    assert unbounded["num_preemptions"] == 0
    assert all(r["prefill_tokens_saved"] <= workload["declared_hits"] for r in workload["rows"])
    assert workload["rows"][0]["hit_rate"] < unbounded["hit_rate"]  # 16 blocks cannot keep three prefixes


def test_memory_map_recording_is_consistent(tmp_path: Path) -> None:
    requests = [dataclasses.replace(r, n=2) if i % 4 == 0 else r for i, r in enumerate(_workload(24))]
    config = PagedConfig(num_blocks=40, block_size=16, max_model_len=MAX_MODEL_LEN)
    recording, result = record_memory_maps(requests, config)
    refs, owners, cached = recording.ref_counts, recording.owners, recording.cached
    assert refs.shape == owners.shape == cached.shape == (result.total_steps, 40)
    assert np.array_equal(refs > 0, owners >= 0)  # a block is owned exactly when it is in use
    assert (refs > 1).any()  # forked samples share their prompt blocks
    assert owners.max() < len(requests)
    highlight = recording.highlight()
    table = recording.tables[highlight]
    assert len(set(table.tolist())) == len(table)  # a sequence never holds one block twice
    picture = render(recording, highlight)
    assert picture.shape == (40, result.total_steps, 3)


def test_memory_map_study(tmp_path: Path) -> None:
    requests = [dataclasses.replace(r, n=2) if i % 4 == 0 else r for i, r in enumerate(_workload(24))]
    result = memory_map_study(requests, tmp_path, num_blocks=40, max_model_len=MAX_MODEL_LEN, workload_label="tiny")
    data = _check_outputs(result, tmp_path, ["memory_map.png"])
    assert data["highlighted_request"] in {r.request_id for r in requests}
    assert data["mean_shared_blocks"] > 0


def test_speed_study(tmp_path: Path) -> None:
    result = speed_study(_workload(30), tmp_path, num_blocks=64, max_model_len=MAX_MODEL_LEN, repeats=1)
    data = _check_outputs(result, tmp_path, [])
    assert data["num_requests"] == 30 and data["steps"] > 0
    assert sum(data["profile_split"].values()) == pytest.approx(1.0)
    assert data["profile_split"]["Scheduler.schedule"] > 0


def test_memory_map_study_with_host_tier(tmp_path: Path) -> None:
    requests = [dataclasses.replace(r, n=2) if i % 4 == 0 else r for i, r in enumerate(_workload(24))]
    config = PagedConfig(
        num_blocks=24, block_size=16, max_model_len=MAX_MODEL_LEN, num_host_blocks=48, preemption_mode="swap"
    )
    recording, result = record_memory_maps(requests, config)
    assert recording.tiered and result.num_swap_preemptions > 0
    assert recording.on_host.shape == (result.total_steps, 24)
    assert recording.host_ref_counts.shape == recording.host_cached.shape == (result.total_steps, 48)
    assert sum(len(w) for w in recording.host_written) == result.blocks_swapped_out
    assert sum(len(r) for r in recording.host_read) == result.blocks_swapped_in
    assert render_host(recording).shape == (48, result.total_steps, 3)
    study = memory_map_study(
        requests,
        tmp_path,
        num_blocks=24,
        max_model_len=MAX_MODEL_LEN,
        workload_label="tiny",
        num_host_blocks=48,
        preemption_mode="swap",
        bytes_per_block=1000,
    )
    data = _check_outputs(study, tmp_path, ["memory_map.png"])
    assert data["num_host_blocks"] == 48 and data["num_swap_preemptions"] > 0
    assert "Host tier (bottom)" in study.body
    # Without a tier: no host panel, nothing recorded for it.
    plain, _ = record_memory_maps(requests, PagedConfig(num_blocks=24, block_size=16, max_model_len=MAX_MODEL_LEN))
    assert not plain.tiered and render_host(plain).size == 0


def test_offload_studies(tmp_path: Path) -> None:
    requests = _workload(60)
    swap = swap_study(requests, tmp_path, num_blocks=16, bytes_per_block=1000, max_model_len=MAX_MODEL_LEN)
    data = _check_outputs(swap, tmp_path, [])
    rows = {row["label"]: row for row in data["rows"]}
    assert data["same_output"]
    assert rows["recompute, no host tier"]["copy_time_s"] == 0
    assert rows["swap"]["num_swap_preemptions"] == rows["swap"]["num_preemptions"] > 0
    assert rows["swap"]["tokens_computed"] < rows["recompute, no host tier"]["tokens_computed"]
    assert data["tokens_needed"] == tokens_needed(requests, MAX_MODEL_LEN)

    prefix = host_tier_prefix_study(
        requests, tmp_path, device_pools=[16], bytes_per_block=1000, host_multiples=(0, 2), max_model_len=MAX_MODEL_LEN
    )
    data = _check_outputs(prefix, tmp_path, ["offload_prefix_cache.png"])
    alone, tiered = data["pools"]["16"]
    assert alone["host_hit_rate"] == 0 and alone["same_total_device"] is None
    assert tiered["hit_rate"] > alone["hit_rate"] and tiered["host_hit_rate"] > 0
    assert tiered["same_total_device"]["num_blocks"] == 48
    assert data["unbounded"]["hit_rate"] >= tiered["hit_rate"]

    retention = retention_study(requests, tmp_path, pool_sizes=[16], top_counts=(1,), max_model_len=MAX_MODEL_LEN)
    data = _check_outputs(retention, tmp_path, [])
    assert [(r["prioritized_prompts"], r["scope"]) for r in data["rows"]] == [
        (0, None),
        (1, "system prompt"),
        (1, "whole prompt"),
    ]
    assert data["popular_prefixes"][0] == Counter(r.shared_prefix_id for r in requests).most_common(1)[0][0]
    assert 0 < data["rows"][0]["top_hit_rate"] <= data["ceiling"]["top"]


def test_retention_study_system_prompt_scope(tmp_path: Path) -> None:
    # 6 system prompts of 3 blocks, private tails of 2-4 blocks, 5 requests/s: one or two run at
    # a time and a 32-block pool caches some of the prompts.
    requests = shared_prefix_requests(
        80,
        num_prefixes=6,
        prefix_len=48,
        user_len=(32, 64),
        output_len=(4, 16),
        seed=0,
        arrivals=ArrivalProcess(rate=5.0),
    )
    study = retention_study(
        requests,
        tmp_path,
        pool_sizes=[32],
        top_counts=(1, 6),
        variants=(("system prompt", None), ("system prompt", 0.5), ("whole prompt", None)),
        max_model_len=MAX_MODEL_LEN,
    )
    data = _check_outputs(study, tmp_path, [])
    rows = {(r["prioritized_prompts"], r["scope"], r["retention_duration"]): r for r in data["rows"]}
    assert len(rows) == 7 and data["watched_prompts"] == 1 and data["num_prefixes"] == 6
    delta = {key: row["delta_hit_rate"] for key, row in rows.items()}
    # The whole-prompt priority keeps the top prompt's private tails and pushes out the other
    # prompts; over the system prompt only it does not.
    assert delta[(1, "whole prompt", None)] < 0 <= delta[(1, "system prompt", None)]
    assert rows[(1, "whole prompt", None)]["rest_hit_rate"] < rows[(0, None, None)]["rest_hit_rate"]
    # Every system prompt prioritized: shared blocks outlive the private ones, a real gain,
    # larger than over the whole prompt, within the unbounded cache's hit rate.
    assert delta[(6, "system prompt", None)] > 0.05
    assert delta[(6, "system prompt", None)] > delta[(6, "whole prompt", None)]
    assert rows[(6, "system prompt", None)]["hit_rate"] <= data["ceiling"]["all"]
    # A short retention duration (simulated seconds) gives part of it back.
    assert delta[(6, "system prompt", 0.5)] < delta[(6, "system prompt", None)]
    assert "| 32 | whole prompt | for good |" in study.body and "all 6 at 80" in study.body
    assert "removes that loss" in study.body
    with pytest.raises(ValueError, match="unknown retention scope"):
        retention_study(requests, tmp_path, pool_sizes=[32], variants=(("tail", None),))
