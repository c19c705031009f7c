"""The live KV-cache page's data (``GET /dashboard/state``) against the scheduler, in-process
(``create_app(engine=...)`` behind httpx's ASGI transport), polled while a workload with shared
prefixes, parallel samples, preemption and an abort runs. The engine serves the tiny random
model (tests/tiny_models.py): the page shows blocks, not text."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from pagedkv import AsyncLLM  # noqa: E402
from pagedkv.server import ServerArgs, create_app  # noqa: E402
from pagedkv.server.dashboard import FREE_CACHED, SHARED, USED  # noqa: E402

ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32", device="cpu", block_size=16, num_blocks=32, max_model_len=320, max_num_seqs=6, num_host_blocks=24
)
PREAMBLE = "A shared preamble about paged attention and block tables, repeated to be cached. " * 3


def decode(b64: str, dtype: Any) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype=dtype)


async def poll_during_workload(engine: AsyncLLM, server_args: ServerArgs) -> list[dict[str, Any]]:
    app = create_app(engine=engine, server_args=server_args)
    headers = {} if server_args.api_key is None else {"Authorization": f"Bearer {server_args.api_key}"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120, headers=headers
    ) as http:
        bodies = [
            {"prompt": PREAMBLE + f"question {i}", "max_tokens": 64, "ignore_eos": True, "n": 1 + i % 2, "seed": i}
            for i in range(6)
        ]
        # Preemption must not hang on how arrivals interleave with steps: these six samples alone
        # need 3 shared prompt blocks + 6 x 7 of their own (54 + 96 tokens each) > 32 blocks.
        bodies.append({"prompt": PREAMBLE + "six samples", "max_tokens": 96, "ignore_eos": True, "n": 6, "seed": 9})
        tasks = [asyncio.create_task(http.post("/v1/completions", json=b)) for b in bodies]
        aborted = asyncio.create_task(
            http.post("/v1/completions", json={"prompt": "to be cut", "max_tokens": 200, "ignore_eos": True})
        )
        states = []
        while not all(t.done() for t in tasks):
            r = await http.get("/dashboard/state")
            assert r.status_code == 200, r.text
            states.append(r.json())
            if len(states) == 3:
                aborted.cancel()  # the client goes away: the request is aborted, its blocks freed
            await asyncio.sleep(0.05)
        for t in tasks:
            assert (await t).status_code == 200
        states.append((await http.get("/dashboard/state")).json())
    return states


def test_state_agrees_with_the_scheduler_under_a_workload(tiny_model: str, tmp_path: Any) -> None:
    disk = {"kv_cache_dir": str(tmp_path), "kv_cache_dir_max_bytes": 20 << 20}
    # With speculative decoding too: drafts in flight under preemption, swap, the disk tier and
    # an abort; the page shows each request's drafted and accepted tokens.
    spec = {"speculative_config": {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}}
    with AsyncLLM(tiny_model, **ENGINE_ARGS, **disk, **spec) as engine:
        states = asyncio.run(poll_during_workload(engine, ServerArgs()))
        engine.engine.scheduler.check_invariants()
    busy = [s for s in states if s["stats"]["num_used_blocks"] > 0]
    assert busy, "the page saw blocks in use"
    saw_shared = False
    for s in states:
        st = s["stats"]
        blocks = decode(s["block_states"], np.uint8)
        owners = decode(s["block_owners"], np.int32)
        assert blocks.size == owners.size == st["num_blocks"] == ENGINE_ARGS["num_blocks"]
        used = np.isin(blocks, (USED, SHARED))
        assert used.sum() == st["num_used_blocks"]
        assert (blocks == FREE_CACHED).sum() <= st["num_cached_blocks"]
        assert decode(s["host_block_states"], np.uint8).size == ENGINE_ARGS["num_host_blocks"]
        assert decode(s["disk_block_states"], np.uint8).size == st["num_disk_blocks"] > 0
        saw_shared |= bool((blocks == SHARED).any())
        # Every block in use belongs to a running request the page lists (no leases here).
        running = {r["arrival"] for r in s["requests"] if r["state"] == "running"}
        assert set(owners[used].tolist()) <= running
        assert sum(r["state"] == "running" for r in s["requests"]) <= st["num_running"]
        for r in s["requests"]:
            assert "prompt" not in r, "no prompt text without --dashboard-show-prompts"
            if r["state"] == "running":
                assert r["blocks"] >= 1 and r["prompt_tokens"] > 0
    assert saw_shared, "the shared preamble's blocks show as shared"
    assert any(r["drafts"][0] > 0 for s in states for r in s["requests"]), "drafts show per request"
    assert all(0 <= r["drafts"][1] <= r["drafts"][0] for s in states for r in s["requests"])
    assert states[-1]["stats"]["num_spec_accepted_tokens"] > 0
    assert states[-1]["stats"]["num_used_blocks"] == 0 and states[-1]["requests"] == []
    last = states[-1]
    assert last["stats"]["num_preemptions"] > 0, "the small pool preempted"
    recent = last["recent_preemptions"]
    assert 0 < len(recent) <= min(20, last["stats"]["num_preemptions"])
    assert all(p["id"].startswith("cmpl-") and p["time"] > 0 for p in recent)


def test_page_auth_and_prompt_text(tiny_model: str) -> None:
    with AsyncLLM(tiny_model, **ENGINE_ARGS) as engine:
        app = create_app(engine=engine, server_args=ServerArgs(api_key="k", dashboard_show_prompts=True))

        async def go() -> None:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                page = await http.get("/dashboard")  # the page itself holds no data: open
                assert page.status_code == 200 and 'id="blocks"' in page.text and "<script>" in page.text
                assert (await http.get("/dashboard/state")).status_code == 401
                auth = {"Authorization": "Bearer k"}
                stream = await engine.add_request("The preamble of a visible prompt", None, "visible")
                r = await http.get("/dashboard/state", headers=auth)
                assert r.status_code == 200
                texts = [q.get("prompt") for q in r.json()["requests"]]
                assert "The preamble of a visible prompt" in texts
                stream.close()

        asyncio.run(go())


def test_kv_cache_groups_show_each_groups_blocks(tmp_path: Any) -> None:
    """A model with KV cache groups (gemma3_text: a 12-token window on two layers of four, so
    one full and one sliding-window KV cache group, pages of two layers): the state says which
    group each device block serves, and while requests longer than the window run, the sliding group
    holds fewer blocks than the full one."""
    from tiny_models import save_tiny_windowed

    from pagedkv import LLM, SamplingParams
    from pagedkv.server.dashboard import encode_state
    from pagedkv.worker.model_files import default_model_dir

    save_tiny_windowed(tmp_path)
    llm = LLM(
        str(tmp_path),
        tokenizer=str(default_model_dir()),
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=64,
        max_model_len=128,
    )
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [(5 * i + j) % 500 + 5 for j in range(60)]}, params)
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        s = encode_state(engine.kv_snapshot(), show_prompts=False)
        assert s["kv_group_spans"] == ["full", "sliding window 12"]
        groups = decode(s["block_kv_groups"], np.int16)
        blocks = decode(s["block_states"], np.uint8)
        used = np.isin(blocks, (USED, SHARED))
        assert groups.size == blocks.size == 64
        assert set(groups[used].tolist()) <= {0, 1}, "every block in use serves a group"
        held = [int((used & (groups == g)).sum()) for g in (0, 1)]
        assert sum(held) == s["stats"]["num_used_blocks"]
        # Three 60-token prompts: 8 blocks each in the full group; once decoding, the sliding
        # group has given back all but the blocks its 12-token window reaches (2 or 3).
        if s["stats"]["num_running"] == 3 and held[0] >= 3 * 8:
            seen += held[1] <= 3 * 3
    assert seen, "the page saw the sliding group give its blocks back"
    final = decode(encode_state(engine.kv_snapshot(), show_prompts=False)["block_kv_groups"], np.int16)
    assert set(final.tolist()) <= {-1, 0, 1} and (final >= 0).any(), "the prompts stay cached, per group"
