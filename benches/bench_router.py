"""Routing benchmark: prefix hit rate, TTFT and throughput of cache-aware vs round-robin
routing over two ``pagedkv serve`` replicas, on the shared-system-prompt workload.

Two replicas (``python -m pagedkv serve`` subprocesses on loopback, one thread each, KV events
on) stay up for the whole run. Each *run* starts a fresh router (``python -m pagedkv router
--policy P``, a subprocess, so streaming and its CPU use are real) in front of them, after
``POST /reset_prefix_cache`` on both replicas, and sends the same ``--num-requests`` requests
through it with ``--concurrency`` in flight (streaming ``/v1/completions``,
``stream_options.include_usage``). Runs alternate the policies over ``--rounds`` rounds
(cache_aware, round_robin, then round_robin, cache_aware, ...) to show the machine's noise.

Workload: :func:`pagedkv.sim.workloads.shared_prefix_requests` picks, for each request, one of
``--num-prompts`` system prompts (seeded, ``--zipf-s`` popularity; 0 = uniform) and gives that
system prompt's tokens (``--prompt-blocks`` full KV blocks each, synthetic ids of the model's
vocabulary); the request's prompt is those tokens followed by a ShareGPT first-turn question
(tokenized, at most ``--max-question`` tokens), sent as token ids. ``max_tokens`` =
``--max-tokens`` with ``ignore_eos``, greedy. Each run sends its own ``cache_salt``, so nothing
an earlier run cached can be hit even if a reset missed it.

KV pool: each replica gets ``--num-blocks`` blocks (default: half the system prompts' blocks
plus a working set of ``concurrency / 2`` longest requests): one replica cannot hold every
system prompt at once, the two together can. That is where routing by cached prefix pays.

Measured per run: prefix hit rate = sum of ``usage.prompt_tokens_details.cached_tokens`` / sum
of ``usage.prompt_tokens``; the router's predicted hit ratio (its ``/metrics``:
``pagedkv_router:predicted_hit_tokens_total / pagedkv_router:prompt_tokens_total``; a
round-robin router subscribes to no events, so it predicts nothing); the replicas' own
``vllm:prefix_cache_hits / queries`` over the run; requests per replica (the
``x-pagedkv-replica`` header); TTFT (first streamed token chunk - send) p50 / p99; E2E; output
tokens/s and requests/s (first send to last token).

    python benches/bench_router.py [--num-requests 64] [--concurrency 8] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import (  # noqa: E402
    add_write_flag,
    cpu_seconds_machine,
    cpu_seconds_pid,
    cpu_seconds_self,
    git_rev,
    machine,
    md_table,
    percentile,
    write_section,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SECTION = "router"
HEADING = "## Routing: cache-aware vs round-robin replicas (issue 13)"
POLICIES = ("cache_aware", "round_robin")


@dataclass(frozen=True)
class Req:
    """One request: its prompt's token ids, which system prompt it starts with, its length."""

    prompt: list[int]
    system: int
    system_len: int
    question_len: int


def build_requests(args: argparse.Namespace) -> list[Req]:
    """System prompts from the shared-prefix workload, each followed by a ShareGPT question."""
    from pagedkv.sim.workloads import shared_prefix_requests, sharegpt_first_turn_requests

    shared = shared_prefix_requests(
        args.num_requests,
        num_prefixes=args.num_prompts,
        prefix_len=args.prompt_blocks * args.block_size,
        user_len=1,
        output_len=args.max_tokens,
        zipf_s=args.zipf_s,
        seed=args.seed,
    )
    questions = sharegpt_first_turn_requests(
        args.num_requests, max_prompt_len=args.max_question, max_model_len=2048, shuffle_seed=args.seed
    )
    if len(questions) < args.num_requests:
        raise SystemExit(f"only {len(questions)} ShareGPT questions of <= {args.max_question} tokens")
    out = []
    for s, q in zip(shared, questions):
        system = s.prompt_token_ids[: s.shared_prefix_len]
        out.append(
            Req(
                [int(t) for t in system] + [int(t) for t in q.prompt_token_ids],
                int(s.shared_prefix_id.rsplit("-", 1)[1]),  # "system-<rank>"
                int(s.shared_prefix_len),
                len(q.prompt_token_ids),
            )
        )
    return out


def ideal_hit_rates(reqs: list[Req], num_replicas: int) -> dict[str, float]:
    """Upper bounds on the hit rate (system prompts are whole blocks, questions share none):
    ``one_cache``: every request after the first of its system prompt hits the whole system
    prompt (one replica big enough for all, or perfect affinity); ``round_robin_unbounded``:
    request i on replica i mod n, each replica's first request of a system prompt misses."""
    total = sum(len(r.prompt) for r in reqs)
    seen: set[int] = set()
    seen_rr: set[tuple[int, int]] = set()
    one = rr = 0
    for i, r in enumerate(reqs):
        if r.system in seen:
            one += r.system_len
        seen.add(r.system)
        key = (i % num_replicas, r.system)
        if key in seen_rr:
            rr += r.system_len
        seen_rr.add(key)
    return {"one_cache": one / total, "round_robin_unbounded": rr / total}


# ----------------------------------------------------------------------------- processes


def start_replicas(args: argparse.Namespace) -> list[Any]:
    """Two `pagedkv serve` replicas with KV events, started in parallel."""
    from pagedkv.server.launch import ServerProcess, free_port

    engine = [
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--block-size",
        str(args.block_size),
        "--num-blocks",
        str(args.num_blocks),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--log-level",
        "warning",
    ]
    procs = []
    for _ in range(2):
        events = ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]
        events += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}"]
        procs.append(ServerProcess([*engine, *events], env={"OMP_NUM_THREADS": "1"}, start_timeout=600))
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(p.start) for p in procs]
        errors = []
        for f in futures:
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - stop the other one, then fail
                errors.append(exc)
    if errors:
        for p in procs:
            p.stop()
        raise errors[0]
    return procs


class RouterProcess:
    """``python -m pagedkv router`` on a free loopback port until :meth:`stop` (its own process
    group; SIGTERM, then SIGKILL)."""

    def __init__(self, replicas: list[str], policy: str) -> None:
        from pagedkv.server.launch import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "pagedkv", "router", "--policy", policy]
        for url in replicas:
            self.cmd += ["--replica", url]
        self.cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self._log = tempfile.NamedTemporaryFile(prefix="pagedkv-router-", suffix=".log", delete=False)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> RouterProcess:
        import httpx

        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pagedkv router exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"pagedkv router did not become healthy in {timeout} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 3000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-num_chars:]

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)
        return self.process.returncode


def scrape(url: str) -> dict[str, float]:
    import httpx

    from pagedkv.server.metrics import parse_metrics

    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def metric_sum(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k.split("{", 1)[0] == name)


def reset_prefix_caches(replicas: list[Any]) -> list[int]:
    import httpx

    dropped = []
    for p in replicas:
        r = httpx.post(p.url + "/reset_prefix_cache", timeout=30)
        r.raise_for_status()
        dropped.append(int(r.json()["num_blocks_dropped"]))
    return dropped


def warm_up(replicas: list[Any], headers: dict[str, str] | None = None) -> None:
    """Two small requests straight to each replica (first-call costs out of the runs);
    ``headers`` authenticate them (a disaggregated deployment's engine key)."""
    import httpx

    for p in replicas:
        for n in (20, 40):
            body = {"prompt": list(range(1000, 1000 + n)), "max_tokens": 4, "ignore_eos": True}
            body["cache_salt"] = "warmup"
            httpx.post(p.url + "/v1/completions", json=body, headers=headers, timeout=120).raise_for_status()


# ----------------------------------------------------------------------------- load generator


@dataclass
class Result:
    index: int
    sent: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    chunks: int = 0
    replica: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False


async def stream_one(http: Any, url: str, body: dict[str, Any], res: Result, t0: float) -> None:
    start = time.perf_counter()
    res.sent = start - t0
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            res.replica = r.headers.get("x-pagedkv-replica")
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.usage = chunk["usage"]
                if chunk.get("choices"):
                    res.chunks += 1
                    if res.ttft is None:
                        res.ttft = time.perf_counter() - start
        res.e2e = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
        res.error = f"{type(exc).__name__}: {exc}"


async def _load(url: str, bodies: list[dict[str, Any]], concurrency: int, cap_s: float) -> tuple[list[Result], int]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    results = [Result(i) for i in range(len(bodies))]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cap_s + 60, connect=10), limits=limits) as http:
        t0 = time.perf_counter()

        async def task(i: int) -> None:
            async with sem:
                await stream_one(http, url, bodies[i], results[i], t0)

        tasks = [asyncio.ensure_future(task(i)) for i in range(len(bodies))]
        _, unfinished = await asyncio.wait(tasks, timeout=cap_s)
        for t in unfinished:
            t.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
    for r in results:
        if r.error is None and not r.done:
            r.error = "cut by the wall-clock cap" if unfinished else "stream ended without [DONE]"
    return results, len(unfinished)


def request_bodies(reqs: list[Req], max_tokens: int, cache_salt: str) -> list[dict[str, Any]]:
    """The streamed completion bodies of ``reqs``: greedy, ``ignore_eos`` (every answer has
    ``max_tokens`` tokens), usage in the last chunk."""
    return [
        {
            "prompt": r.prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": cache_salt,
        }
        for r in reqs
    ]


def client_figures(
    results: list[Result], reqs: list[Req], max_tokens: int
) -> tuple[list[Result], dict[str, Any], dict[str, int]]:
    """What the client saw of one run: the completed results; their token counts, seconds (first
    send to last token), output tok/s, req/s, TTFT and E2E percentiles; and the checks every
    streamed answer must pass (whole, usage right, one chunk per token)."""
    ok = [r for r in results if r.error is None and r.usage is not None]
    prompt_tokens = sum(r.usage["prompt_tokens"] for r in ok)  # type: ignore[index]
    cached = sum((r.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in ok)  # type: ignore[union-attr]
    out_tokens = sum(r.usage["completion_tokens"] for r in ok)  # type: ignore[index]
    end = max((r.sent + (r.e2e or 0.0) for r in ok), default=float("nan"))
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    figures = {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else float("nan"),
        "seconds": end,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / end,
        "req_s": len(ok) / end,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "ttft_mean": float(np.mean(ttfts)) if ttfts else float("nan"),
        "e2e_p50": percentile(e2es, 50),
        "e2e_p99": percentile(e2es, 99),
    }
    checks = {
        "failed": len(results) - len(ok),
        "completion_tokens_not_max_tokens": sum(r.usage["completion_tokens"] != max_tokens for r in ok),  # type: ignore[index]
        "chunks_not_completion_tokens": sum(r.chunks != r.usage["completion_tokens"] for r in ok),  # type: ignore[index]
        "prompt_tokens_not_sent": sum(r.usage["prompt_tokens"] != len(reqs[r.index].prompt) for r in ok),  # type: ignore[index]
    }
    return ok, figures, checks


def run_policy(
    args: argparse.Namespace,
    replicas: list[Any],
    reqs: list[Req],
    policy: str,
    round_no: int,
    problems: list[str],
) -> dict[str, Any]:
    """Reset both caches, start a router with `policy`, send every request through it."""
    label = f"{policy}-{round_no}"
    dropped = reset_prefix_caches(replicas)
    before = [scrape(p.url) for p in replicas]
    t = time.perf_counter()
    router = RouterProcess([p.url for p in replicas], policy).start()
    router_start_s = time.perf_counter() - t
    try:
        bodies = request_bodies(reqs, args.max_tokens, f"{label}-{args.seed}")
        pids = [p.process.pid for p in replicas] + [router.process.pid]  # type: ignore[union-attr]
        c0 = [cpu_seconds_pid(pid) for pid in pids]
        s0, m0 = cpu_seconds_self(), cpu_seconds_machine()
        results, num_cut = asyncio.run(_load(router.url, bodies, args.concurrency, args.run_cap))
        cpu = [cpu_seconds_pid(pid) - c for pid, c in zip(pids, c0)]
        client_cpu = cpu_seconds_self() - s0
        others_cpu = max(0.0, cpu_seconds_machine() - m0 - sum(cpu) - client_cpu)
        router_metrics = scrape(router.url)
        if any(r.error for r in results):
            problems.append(f"{label}: router log tail:\n{router.log_tail()}")
    finally:
        router.stop()
    after = [scrape(p.url) for p in replicas]

    ok, figures, checks = client_figures(results, reqs, args.max_tokens)
    prompt_tokens = figures["prompt_tokens"]
    # After the first `concurrency` requests (sent at once into empty caches; both policies
    # route those alike, as no replica holds anything yet).
    warm_ttfts = [r.ttft for r in ok if r.ttft is not None and r.index >= args.concurrency]
    slowest = sorted((r for r in ok if r.ttft is not None), key=lambda r: -r.ttft)[: args.concurrency]
    urls = [p.url for p in replicas]
    per_replica = [sum(r.replica == u for r in ok) for u in urls]
    systems_per_replica = [sorted({reqs[r.index].system for r in ok if r.replica == u}) for u in urls]
    # System prompts served by both replicas (cached twice: the pool pays for them twice).
    both = len(set(systems_per_replica[0]) & set(systems_per_replica[1]))
    hits_per_replica = []
    for u in urls:
        mine = [r for r in ok if r.replica == u]
        p_tok = sum(r.usage["prompt_tokens"] for r in mine)  # type: ignore[index]
        c_tok = sum((r.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in mine)  # type: ignore[union-attr]
        hits_per_replica.append(c_tok / p_tok if p_tok else float("nan"))
    rq = metric_sum(router_metrics, "pagedkv_router:prompt_tokens_total")
    rp = metric_sum(router_metrics, "pagedkv_router:predicted_hit_tokens_total")
    decisions = {
        k.split("reason=", 1)[1].rstrip("}"): v
        for k, v in router_metrics.items()
        if k.startswith("pagedkv_router:routing_decisions_total{")
    }
    routed = {u: router_metrics.get(f"pagedkv_router:requests_total{{replica={u}}}", 0.0) for u in urls}
    server_q = sum(
        metric_sum(a, "vllm:prefix_cache_queries_total") - metric_sum(b, "vllm:prefix_cache_queries_total")
        for a, b in zip(after, before)
    )
    server_h = sum(
        metric_sum(a, "vllm:prefix_cache_hits_total") - metric_sum(b, "vllm:prefix_cache_hits_total")
        for a, b in zip(after, before)
    )
    preempt = sum(
        metric_sum(a, "vllm:num_preemptions_total") - metric_sum(b, "vllm:num_preemptions_total")
        for a, b in zip(after, before)
    )
    # Checks: every response whole, usage right, the router's counts = what the client saw.
    checks["router_prompt_tokens_not_usage"] = int(rq != prompt_tokens)
    checks["router_requests_not_headers"] = int([routed[u] for u in urls] != per_replica)
    if any(checks.values()):
        errs = [f"request {r.index}: {r.error}" for r in results if r.error][:5]
        problems.append(f"{label}: checks {checks}; errors {errs}")
    return {
        "label": label,
        "policy": policy,
        "round": round_no,
        "requests": len(reqs),
        "concurrency": args.concurrency,
        "completed": len(ok),
        "cut_by_cap": num_cut,
        **figures,
        "router_start_s": router_start_s,
        "reset_blocks_dropped": dropped,
        "router_prompt_tokens": rq,
        "router_predicted_hit_tokens": rp,
        "predicted_hit_rate": rp / rq if rq else float("nan"),
        "router_decisions": decisions,
        "server_prefix_queries": server_q,
        "server_prefix_hits": server_h,
        "server_hit_rate": server_h / server_q if server_q else float("nan"),
        "preemptions": preempt,
        "requests_per_replica": per_replica,
        "hit_rate_per_replica": hits_per_replica,
        "system_prompts_per_replica": systems_per_replica,
        "system_prompts_on_both": both,
        "ttft_p50_warm": percentile(warm_ttfts, 50),
        "ttft_p99_warm": percentile(warm_ttfts, 99),
        "slowest_ttfts_among_first": sum(r.index < args.concurrency for r in slowest),
        "cpu_s_replicas": cpu[:2],
        "cpu_s_router": cpu[2],
        "cpu_s_client": client_cpu,
        "cpu_s_others": others_cpu,
        "checks": checks,
        # Per request, in send order: [replica index, system prompt, cached tokens, TTFT s, E2E s].
        "per_request": [
            [
                urls.index(r.replica) if r.replica in urls else -1,
                reqs[r.index].system,
                (r.usage or {}).get("prompt_tokens_details", {}).get("cached_tokens") if r.usage else None,
                None if r.ttft is None else round(r.ttft, 4),
                None if r.e2e is None else round(r.e2e, 4),
            ]
            for r in results
        ],
    }


# ----------------------------------------------------------------------------- report


def plot(path: Path, runs: list[dict[str, Any]], ideal: dict[str, float]) -> None:
    from studies.plotting import new_figure, save_png

    fig = new_figure(13, 4.2)
    axes = fig.subplots(1, 3)
    names = {"cache_aware": "cache-\naware", "round_robin": "round-\nrobin"}
    labels = [f"{names[r['policy']]}\nround {r['round']}" for r in runs]
    colors = ["C0" if r["policy"] == "cache_aware" else "C1" for r in runs]
    x = np.arange(len(runs))
    ax = axes[0]
    ax.bar(x, [100 * r["hit_rate"] for r in runs], color=colors, label="measured (usage cached_tokens)")
    pred = [(i, 100 * r["predicted_hit_rate"]) for i, r in enumerate(runs) if r["predicted_hit_rate"] > 0]
    if pred:
        ax.plot(*zip(*pred), "k_", ms=22, mew=2, label="router's prediction")
    ax.axhline(100 * ideal["one_cache"], color="k", ls=":", lw=1, label="bound: every prompt cached once")
    ax.axhline(100 * ideal["round_robin_unbounded"], color="C1", ls="--", lw=1, label="bound: round robin")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title("prefix hit rate")
    ax.set_ylim(0, 130)
    ax.set_yticks(range(0, 101, 20))
    ax.legend(fontsize=6.5, loc="upper left")
    ax = axes[1]
    w = 0.27
    n_first = runs[0]["concurrency"]
    ax.bar(x - w, [r["ttft_p50"] for r in runs], w, color=colors, label="p50")
    ax.bar(x, [r["ttft_p99"] for r in runs], w, color=colors, alpha=0.5, hatch="//", label="p99")
    ax.bar(
        x + w,
        [r["ttft_p99_warm"] for r in runs],
        w,
        color=colors,
        alpha=0.3,
        hatch="..",
        label=f"p99 after the first {n_first}",
    )
    ax.set_ylabel("seconds")
    ax.set_title("time to first token")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.bar(x, [r["output_tok_s"] for r in runs], color=colors)
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput")
    for ax in axes:
        ax.set_xticks(x, labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8, help="distinct system prompts")
    ap.add_argument("--prompt-blocks", type=int, default=16, help="KV blocks per system prompt")
    ap.add_argument("--zipf-s", type=float, default=0.0, help="system prompt popularity (0: uniform)")
    ap.add_argument("--max-question", type=int, default=128, help="longest ShareGPT question (tokens)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight through the router")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool per replica (default: see above)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="per replica (default: --concurrency)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both policies, alternating the order")
    ap.add_argument("--run-cap", type=float, default=240.0, help="wall-clock cap of one run (seconds)")
    ap.add_argument("--max-minutes", type=float, default=10.0, help="skip later rounds past this budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 requests, 4 short prompts, one round")
    add_write_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.num_prompts, args.prompt_blocks, args.max_question = 16, 4, 6, 32
        args.max_tokens, args.concurrency, args.rounds, args.run_cap, args.no_write = 8, 4, 1, 45.0, True
    args.max_num_seqs = args.max_num_seqs or args.concurrency
    system_blocks = args.num_prompts * args.prompt_blocks
    seq_blocks = args.prompt_blocks + -(-(args.max_question + args.max_tokens) // args.block_size)
    args.max_model_len = seq_blocks * args.block_size
    if args.num_blocks is None:
        args.num_blocks = -(-system_blocks // 2) + -(-args.concurrency // 2) * (seq_blocks - args.prompt_blocks)
    t_start = time.perf_counter()

    reqs = build_requests(args)
    ideal = ideal_hit_rates(reqs, 2)
    n_prompt = sum(len(r.prompt) for r in reqs)
    uses = np.bincount([r.system for r in reqs], minlength=args.num_prompts).tolist()
    print(
        f"{len(reqs)} requests, {n_prompt} prompt tokens ({sum(r.system_len for r in reqs)} of them system prompt); "
        f"{args.num_prompts} system prompts x {args.prompt_blocks} blocks = {system_blocks} blocks, used "
        f"{uses} times; pool {args.num_blocks} blocks per replica; hit-rate bounds {ideal}",
        flush=True,
    )
    if args.num_blocks >= system_blocks or 2 * args.num_blocks < system_blocks:
        print("note: the pool does not split the system prompts as intended", flush=True)

    problems: list[str] = []
    runs: list[dict[str, Any]] = []
    skipped = 0
    t = time.perf_counter()
    replicas = start_replicas(args)
    startup_s = time.perf_counter() - t
    try:
        warm_up(replicas)
        print(f"replicas up in {startup_s:.1f} s: {[p.url for p in replicas]}", flush=True)
        schedule = [
            (round_no, policy)
            for round_no in range(1, args.rounds + 1)
            for policy in (POLICIES if round_no % 2 else POLICIES[::-1])
        ]
        for k, (round_no, policy) in enumerate(schedule):
            if runs:
                elapsed = time.perf_counter() - t_start
                per_run = max(r["seconds"] + r["router_start_s"] for r in runs) + 5
                if elapsed + 1.2 * per_run > 60 * args.max_minutes:
                    skipped = len(schedule) - k
                    print(f"skipping {skipped} run(s): {elapsed:.0f} s spent, ~{per_run:.0f} s per run", flush=True)
                    break
            r = run_policy(args, replicas, reqs, policy, round_no, problems)
            runs.append(r)
            print(
                f"  round {round_no} {policy:11s}: hit rate {100 * r['hit_rate']:.1f}% (router predicted "
                f"{100 * r['predicted_hit_rate']:.1f}%), per replica {r['requests_per_replica']}, TTFT p50 "
                f"{r['ttft_p50']:.2f} s p99 {r['ttft_p99']:.2f} s, {r['output_tok_s']:.1f} out tok/s, "
                f"{r['seconds']:.1f} s, others' CPU {r['cpu_s_others']:.1f} s",
                flush=True,
            )
    finally:
        logs = [p.log_tail(2000) for p in replicas]
        for p in replicas:
            p.stop()
    if any("Traceback" in log or "ERROR" in log for log in logs):
        problems.append("replica log tails:\n" + "\n---\n".join(logs))
    total_s = time.perf_counter() - t_start

    # ---- figures
    def mean(policy: str, key: str) -> float:
        return float(np.mean([r[key] for r in runs if r["policy"] == policy]))

    summary = {
        p: {
            k: mean(p, k)
            for k in (
                "hit_rate",
                "predicted_hit_rate",
                "server_hit_rate",
                "ttft_p50",
                "ttft_p99",
                "ttft_p99_warm",
                "output_tok_s",
            )
        }
        | {
            "replica_cpu_s": float(np.mean([sum(r["cpu_s_replicas"]) for r in runs if r["policy"] == p])),
            "others_cpu_s": float(np.mean([r["cpu_s_others"] for r in runs if r["policy"] == p])),
            # Other jobs only slow a run down: the best run of a policy is its least disturbed.
            "best_ttft_p50": min(r["ttft_p50"] for r in runs if r["policy"] == p),
            "best_output_tok_s": max(r["output_tok_s"] for r in runs if r["policy"] == p),
        }
        for p in POLICIES
        if any(r["policy"] == p for r in runs)
    }
    rows = [
        [
            r["round"],
            r["policy"],
            f"{r['completed']}/{r['requests']}",
            f"{100 * r['hit_rate']:.1f}%",
            "n/a" if r["policy"] == "round_robin" else f"{100 * r['predicted_hit_rate']:.1f}%",
            f"{100 * r['server_hit_rate']:.1f}%",
            " / ".join(str(n) for n in r["requests_per_replica"]),
            " / ".join(f"{100 * h:.0f}%" for h in r["hit_rate_per_replica"]),
            r["system_prompts_on_both"],
            r["ttft_p50"],
            r["ttft_p99"],
            r["ttft_p50_warm"],
            r["ttft_p99_warm"],
            r["e2e_p50"],
            r["output_tok_s"],
            r["req_s"],
            r["seconds"],
            int(r["preemptions"]),
            f"{sum(r['cpu_s_replicas']):.0f} / {r['cpu_s_router']:.1f} / {r['cpu_s_client']:.1f}",
            round(r["cpu_s_others"], 1),
        ]
        for r in runs
    ]
    headers = [
        "round",
        "policy",
        "requests done",
        "prefix hit rate",
        "router predicted",
        "replicas' hit rate",
        "requests per replica",
        "hit rate per replica",
        "system prompts on both",
        "TTFT p50 s",
        "TTFT p99 s",
        f"TTFT p50 s after {args.concurrency}",
        f"TTFT p99 s after {args.concurrency}",
        "E2E p50 s",
        "output tok/s",
        "req/s",
        "seconds",
        "preemptions",
        "CPU s replicas / router / client",
        "other jobs' CPU s",
    ]
    table = md_table(headers, rows)
    mean_q = float(np.mean([r.question_len for r in reqs]))
    desc = (
        f"{len(reqs)} requests (seed {args.seed}): {args.num_prompts} system prompts of {args.prompt_blocks} blocks "
        f"x {args.block_size} tokens (`shared_prefix_requests`, synthetic token ids, zipf_s {args.zipf_s:g}; used "
        f"{uses} times), each followed by a ShareGPT first-turn question (<= {args.max_question} tokens, mean "
        f"{mean_q:.0f}): {n_prompt} prompt tokens, sent as token ids; `max_tokens` {args.max_tokens}, `ignore_eos`, "
        f"greedy, streaming `/v1/completions` with `stream_options.include_usage`, {args.concurrency} in flight. "
        f"Two `pagedkv serve` replicas (embedded SmolLM2-135M-Instruct, float32, CPU, OMP_NUM_THREADS=1 each, KV "
        f"events on), each with a pool of **{args.num_blocks} blocks** (max_model_len {args.max_model_len}, "
        f"max_num_seqs {args.max_num_seqs}); the system prompts take **{system_blocks} blocks** in all: one replica "
        f"cannot hold them all, the two together can ({2 * args.num_blocks} blocks). Per run: "
        f"`POST /reset_prefix_cache` on both replicas, a fresh `python -m pagedkv router --policy P` subprocess, "
        f"its own `cache_salt`; the client (httpx, this process) talks to the router over loopback; everything "
        f"shares the machine's {os.cpu_count()} cores. Runs alternate the policies: "
        f"{', '.join(r['label'] for r in runs)}."
    )
    defs = (
        "Prefix hit rate = sum of `usage.prompt_tokens_details.cached_tokens` / sum of `usage.prompt_tokens`; "
        "router predicted = its `/metrics` `pagedkv_router:predicted_hit_tokens_total / "
        "pagedkv_router:prompt_tokens_total` (the blocks its index said the chosen replica held when it routed; "
        "a round-robin router subscribes to no KV events, so it predicts nothing); replicas' hit rate = their "
        "`vllm:prefix_cache_hits / vllm:prefix_cache_queries` over the run; system prompts on both = distinct "
        "system prompts that both replicas served (and so cached twice). Bounds: every request after the first "
        f"of its system prompt hits it whole = {100 * ideal['one_cache']:.1f}%; round robin (request i on replica i "
        f"mod 2) with unbounded caches = {100 * ideal['round_robin_unbounded']:.1f}%. TTFT = first streamed token "
        "chunk - send (through the router); output tok/s and req/s from the first send to the last token. "
        "CPU s: the two replicas', the router's and the client's during the run; other jobs' CPU s: the "
        "machine's busy time less those (other work on this shared machine)."
    )
    parts = []
    for p, s in summary.items():
        parts.append(
            f"{p}: hit rate {100 * s['hit_rate']:.1f}%, TTFT p50 {s['ttft_p50']:.2f} s / p99 {s['ttft_p99']:.2f} s "
            f"(p99 after the first {args.concurrency}: {s['ttft_p99_warm']:.2f} s), {s['output_tok_s']:.1f} output tok/s"
        )
    verdict = "Mean over rounds: " + "; ".join(parts) + "."
    if len(summary) == 2:
        ca, rr = summary["cache_aware"], summary["round_robin"]
        verdict += (
            f" Cache-aware / round-robin: hit rate {100 * ca['hit_rate']:.1f}% vs {100 * rr['hit_rate']:.1f}% "
            f"({ca['hit_rate'] / rr['hit_rate']:.2f}x), TTFT p50 {ca['ttft_p50'] / rr['ttft_p50']:.2f}x, "
            f"output tok/s {ca['output_tok_s'] / rr['output_tok_s']:.2f}x; best run of each (other jobs only slow "
            f"a run down): TTFT p50 {ca['best_ttft_p50']:.2f} vs {rr['best_ttft_p50']:.2f} s "
            f"({ca['best_ttft_p50'] / rr['best_ttft_p50']:.2f}x), output tok/s {ca['best_output_tok_s']:.1f} vs "
            f"{rr['best_output_tok_s']:.1f} ({ca['best_output_tok_s'] / rr['best_output_tok_s']:.2f}x). The "
            f"replicas' CPU time for the same requests, which other jobs barely change: {ca['replica_cpu_s']:.1f} vs "
            f"{rr['replica_cpu_s']:.1f} s per run ({ca['replica_cpu_s'] / rr['replica_cpu_s']:.2f}x); other jobs "
            f"took {ca['others_cpu_s']:.1f} vs {rr['others_cpu_s']:.1f} CPU s per run."
        )
    first = sum(r["slowest_ttfts_among_first"] for r in runs)
    verdict += (
        f" Of the {args.concurrency} slowest TTFTs of each run, {first} of {args.concurrency * len(runs)} are among "
        f"the first {args.concurrency} requests (sent at once into empty caches, routed alike by both policies)"
        + (
            ": the TTFT p99 over all requests is that cold start, hence the p99 after them."
            if first == args.concurrency * len(runs)
            else "."
        )
    )
    if skipped:
        verdict += f" {skipped} run(s) skipped for the {args.max_minutes:g}-minute budget."
    notes = "\n".join(f"- {p}" for p in problems) if problems else "- none"
    print(desc)
    print(table)
    print(verdict)
    print(f"Problems / checks:\n{notes}")
    print(f"Benchmark run time: {total_s:.0f} s (replicas up in {startup_s:.0f} s)")
    if args.no_write:
        return
    command = ("python benches/bench_router.py " + " ".join(sys.argv[1:])).strip()
    png = RESULTS_DIR / "router_hit_rate.png"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(png, runs, ideal)
    checks = (
        "Checks on every response: streamed to `[DONE]` with a usage chunk, completion_tokens = max_tokens = "
        "token chunks received, prompt_tokens = the ids sent; the router's `pagedkv_router:prompt_tokens_total` "
        "= the usage's sum and its `requests_total` per replica = the `x-pagedkv-replica` headers. Problems:\n" + notes
    )
    body = (
        f"{desc}\n\n{table}\n\n{verdict}\n\n{defs}\n\n"
        f"![prefix hit rate, TTFT and throughput per routing policy](results/router_hit_rate.png)\n\n"
        f"{checks}\n\nBenchmark run time: {total_s:.0f} s."
    )
    write_section(SECTION, command, body, HEADING)
    data = {
        "command": command,
        "machine": machine(),
        "commit": git_rev(),
        "config": vars(args),
        "system_prompt_blocks": system_blocks,
        "pool_blocks_per_replica": args.num_blocks,
        "requests": {
            "count": len(reqs),
            "prompt_tokens": n_prompt,
            "system_prompt_uses": uses,
            "order": [r.system for r in reqs],
            "question_lens": [r.question_len for r in reqs],
        },
        "hit_rate_bounds": ideal,
        "runs": runs,
        "summary": summary,
        "runs_skipped": skipped,
        "replica_startup_s": startup_s,
        "problems": problems,
        "run_time_s": total_s,
    }
    (RESULTS_DIR / "router_hit_rate.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS_DIR / "router_hit_rate.md").write_text(
        f"# Routing: cache-aware vs round-robin replicas (issue 13)\n\nCommand: `{command}`  \n"
        f"Machine: {machine()}  \nCommit: {git_rev()}\n\n"
        + body.replace("(results/router_hit_rate.png)", "(router_hit_rate.png)")
        + "\n"
    )
    print(f"wrote {png}, router_hit_rate.json/.md and the '{SECTION}' section of benches/RESULTS.md")


if __name__ == "__main__":
    main()
