"""Disaggregated prefill/decode vs a colocated engine vs two replicas behind the router, on
the same requests.

Deployments, each started fresh, measured, and stopped before the next (loopback only; every
process in its own process group, stopped in a ``finally``):

* ``colocated``: one ``pagedkv serve`` engine, one thread (``OMP_NUM_THREADS=1``); the client
  talks to it directly.
* ``colocated-2t``: the same engine with two threads: the CPU a two-engine deployment uses.
* ``disagg-<transport>``: :func:`pagedkv.router.launcher.start_disagg`: a prefill engine
  (producer), a decode engine (consumer), one thread each, and ``pagedkv router --prefill URL
  --decode URL`` in front; the decode engine pulls each prompt's KV blocks over the transport:
  ``disagg`` in ``--deployments`` is ``--kv-transport`` (auto: NIXL when installed, else
  gloo), ``disagg-gloo`` / ``disagg-nixl`` name one (each transport runs once).
* ``replicas-cache_aware`` / ``replicas-round_robin``: two engines, one thread each, KV events
  on (:func:`bench_router.start_replicas`), behind ``pagedkv router --policy P``.

Every engine gets the same engine flags (embedded SmolLM2-135M-Instruct, ``--device cpu
--dtype float32``, ``--num-blocks``, ``--block-size``, ``--max-model-len``,
``--max-num-seqs``); routers run with one thread too. Everything shares the machine's cores:
a two-engine deployment has two busy processes plus a router, the colocated one a single
process, which is what the "processes x threads" column says.

Requests (the routing benchmark's workload, :func:`bench_router.build_requests`): each is one
of ``--num-prompts`` system prompts (``--prompt-blocks`` KV blocks of synthetic token ids)
followed by a ShareGPT first-turn question (at most ``--max-question`` tokens), sent as token
ids; ``max_tokens`` = ``--max-tokens``, ``ignore_eos``, greedy, streaming ``/v1/completions``
with ``stream_options.include_usage``, ``--concurrency`` in flight, the same ``cache_salt``
in every deployment (each starts with empty caches). Before measuring, two small requests go
to each engine and through the entry point (first-call costs, and for ``disagg`` the KV
transport's handshake, out of the run). ``--rounds`` rounds, the deployments' order reversed
every other round (the machine is shared: its noise shows between rounds).

Measured per deployment: the CPU its processes burn idle (``--idle-s`` seconds after the
warm-up); TTFT (first streamed token chunk - send) p50 / p99, E2E p50, output tokens/s and
requests/s (first send to last token); the prefix hit rate of the engines that prefill (their ``vllm:prefix_cache_hits / queries`` over the run: the engine, both replicas,
or the prefill engine) and the usage's ``cached_tokens / prompt_tokens``; each process's CPU
seconds and the rest of the machine's. For ``disagg``: the decode engine's
``pagedkv:kv_loads_ok`` / ``kv_loads_failed`` / ``kv_blocks_pulled`` / ``kv_transfer_seconds``
(its ``/metrics``), the prefill engine's leases, and the router's
``pagedkv_router:disagg_requests_total``, ``disagg_fallbacks_total{reason}`` (must be 0) and
``prefill_seconds``.

    python benches/bench_disagg.py [--num-requests 32] [--max-tokens 32] [--concurrency 8] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
    write_section,
)
from bench_router import (  # noqa: E402
    Req,
    _load,
    build_requests,
    client_figures,
    metric_sum,
    request_bodies,
    scrape,
    start_replicas,
    warm_up,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SECTION = "disagg"
HEADING = "## Disaggregated prefill/decode vs colocated vs replicas (issue 13)"
DEPLOYMENTS = (
    "colocated",
    "colocated-2t",
    "disagg",
    "disagg-gloo",
    "disagg-nixl",
    "replicas-cache_aware",
    "replicas-round_robin",
)
DEFAULT_DEPLOYMENTS = (
    "colocated",
    "colocated-2t",
    "disagg",
    "disagg-gloo",
    "replicas-cache_aware",
    "replicas-round_robin",
)
BASELINE = "colocated"


@dataclass
class Deployment:
    """What one deployment is: where clients go, its engines by role, its router, how to stop."""

    name: str
    url: str
    engines: dict[str, Any]  # role -> ServerProcess
    router: Any | None
    stop: Callable[[], None]
    layout: str  # processes x threads, for the table
    engine_headers: dict[str, str] = field(default_factory=dict)  # direct requests to the engines

    @property
    def pids(self) -> dict[str, int]:
        procs = {**self.engines, **({"router": self.router} if self.router is not None else {})}
        return {role: p.process.pid for role, p in procs.items()}

    def log_tails(self) -> str:
        procs = {**self.engines, **({"router": self.router} if self.router is not None else {})}
        return "\n---\n".join(f"{role}:\n{p.log_tail(1500)}" for role, p in procs.items())


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags every engine gets (the same as bench_router's replicas)."""
    flags = {
        "--dtype": "float32",
        "--device": "cpu",
        "--block-size": args.block_size,
        "--num-blocks": args.num_blocks,
        "--max-model-len": args.max_model_len,
        "--max-num-seqs": args.max_num_seqs,
        "--log-level": "warning",
    }
    return [str(x) for item in flags.items() for x in item]


def start_deployment(name: str, args: argparse.Namespace) -> Deployment:
    """Start deployment `name` and return once its entry point is healthy (on failure,
    whatever was started is stopped)."""
    from pagedkv.router.launcher import RouterProcess, start_disagg
    from pagedkv.server.launch import ServerProcess

    one_thread = {"OMP_NUM_THREADS": "1"}
    if name.startswith("colocated"):
        threads = 2 if name.endswith("-2t") else 1
        p = ServerProcess(engine_flags(args), env={"OMP_NUM_THREADS": str(threads)}, start_timeout=args.start_timeout)
        p.start()
        return Deployment(name, p.url, {"engine": p}, None, p.stop, f"1 engine x {threads} thread(s)")
    if name.startswith("disagg-"):
        d = start_disagg(
            None,
            engine_flags(args),
            name.split("-", 1)[1],
            env=one_thread,
            router_flags=["--log-level", "warning"],
            start_timeout=args.start_timeout,
        )
        layout = "2 engines (prefill + decode) x 1 thread + router x 1"
        engines = {"prefill": d.prefill, "decode": d.decode}
        return Deployment(name, d.url, engines, d.router, d.stop, layout, d.engine_headers())
    policy = name.split("-", 1)[1]
    replicas = start_replicas(args)
    router_args = ["--policy", policy, "--log-level", "warning"]
    for p in replicas:
        router_args += ["--replica", p.url]
    router = RouterProcess(router_args, env=one_thread, start_timeout=args.start_timeout)

    def stop() -> None:
        router.stop()
        for p in replicas:
            p.stop()

    try:
        router.start()
    except BaseException:
        stop()
        raise
    engines = {f"replica-{i + 1}": p for i, p in enumerate(replicas)}
    return Deployment(name, router.url, engines, router, stop, "2 engines x 1 thread + router x 1")


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return metric_sum(after, name) - metric_sum(before, name)


def run_deployment(
    name: str, round_no: int, args: argparse.Namespace, reqs: list[Req], problems: list[str]
) -> dict[str, Any]:
    """Start `name` fresh, warm it up, send every request through its entry point, stop it."""
    import httpx

    t = time.perf_counter()
    dep = start_deployment(name, args)
    start_s = time.perf_counter() - t
    try:
        engines = list(dep.engines.values())
        warm_up(engines, dep.engine_headers)
        if dep.router is not None:
            warm_up([dep])  # through the router (disagg: a prefill, a pull, a decode)
        transport = None
        if "decode" in dep.engines:
            decode_url = dep.engines["decode"].url
            info = httpx.get(decode_url + "/kv_cache_info", headers=dep.engine_headers, timeout=10).json()
            transport = (info.get("kv_transfer") or {}).get("transport")
        # What the deployment burns doing nothing (a busy-polling thread shows here).
        pids = dep.pids
        c0 = {role: cpu_seconds_pid(pid) for role, pid in pids.items()}
        time.sleep(args.idle_s)
        idle_cores = {role: (cpu_seconds_pid(pid) - c0[role]) / args.idle_s for role, pid in pids.items()}
        bodies = request_bodies(reqs, args.max_tokens, f"disagg-bench-{args.seed}")
        before = {role: scrape(p.url) for role, p in dep.engines.items()}
        router_before = scrape(dep.router.url) if dep.router is not None else {}
        c0 = {role: cpu_seconds_pid(pid) for role, pid in pids.items()}
        s0, m0 = cpu_seconds_self(), cpu_seconds_machine()
        results, num_cut = asyncio.run(_load(dep.url, bodies, args.concurrency, args.run_cap))
        cpu = {role: cpu_seconds_pid(pid) - c0[role] for role, pid in pids.items()}
        client_cpu = cpu_seconds_self() - s0
        others_cpu = max(0.0, cpu_seconds_machine() - m0 - sum(cpu.values()) - client_cpu)
        after = {role: scrape(p.url) for role, p in dep.engines.items()}
        router_after = scrape(dep.router.url) if dep.router is not None else {}
        if any(r.error for r in results):
            problems.append(f"{name}: log tails:\n{dep.log_tails()}")
    finally:
        tails = dep.log_tails()
        dep.stop()
    if "Traceback" in tails:
        problems.append(f"{name}: a traceback in the logs:\n{tails}")

    ok, figures, checks = client_figures(results, reqs, args.max_tokens)
    # The engines that prefill: the engine, both replicas, or the prefill engine.
    prefilling = [role for role in dep.engines if role != "decode"]
    hits = sum(delta(after[role], before[role], "vllm:prefix_cache_hits_total") for role in prefilling)
    queries = sum(delta(after[role], before[role], "vllm:prefix_cache_queries_total") for role in prefilling)
    preemptions = sum(delta(after[role], before[role], "vllm:num_preemptions_total") for role in dep.engines)
    urls = {p.url: role for role, p in dep.engines.items()}
    if dep.router is None:  # clients talk to the one engine (no x-pagedkv-replica header)
        per_engine = {role: len(ok) for role in dep.engines}
    else:
        per_engine = {role: sum(urls.get(r.replica or "") == role for r in ok) for role in dep.engines}
    if "prefill" in dep.engines:  # the answer names the decode engine; the router counts prefills
        key = f"pagedkv_router:requests_total{{replica={dep.engines['prefill'].url}}}"
        per_engine["prefill"] = int(router_after.get(key, 0.0) - router_before.get(key, 0.0))
    out: dict[str, Any] = {
        "deployment": name,
        "round": round_no,
        "layout": dep.layout,
        "start_s": start_s,
        "requests": len(reqs),
        "completed": len(ok),
        "cut_by_cap": num_cut,
        **figures,  # the usage's cached / prompt tokens ("hit_rate"), throughput, TTFT, E2E
        "engine_prefix_hits": hits,
        "engine_prefix_queries": queries,
        "engine_hit_rate": hits / queries if queries else float("nan"),
        "preemptions": preemptions,
        "requests_per_engine": per_engine,
        "cpu_s": cpu,
        "idle_cores": idle_cores,
        "cpu_s_engines": sum(v for role, v in cpu.items() if role != "router"),
        "cpu_s_router": cpu.get("router", 0.0),
        "cpu_s_client": client_cpu,
        "cpu_s_others": others_cpu,
        "checks": checks,
        # Per request, in send order: [TTFT s, E2E s, cached tokens].
        "per_request": [
            [
                None if r.ttft is None else round(r.ttft, 4),
                None if r.e2e is None else round(r.e2e, 4),
                (r.usage or {}).get("prompt_tokens_details", {}).get("cached_tokens") if r.usage else None,
            ]
            for r in results
        ],
    }
    if name.startswith("disagg-"):
        dec_b, dec_a = before["decode"], after["decode"]
        pre_b, pre_a = before["prefill"], after["prefill"]
        fallbacks = {
            k.split("reason=", 1)[1].rstrip("}"): v - router_before.get(k, 0.0)
            for k, v in router_after.items()
            if k.startswith("pagedkv_router:disagg_fallbacks_total{")
        }
        disagg = {
            "transport": transport,
            "disagg_requests": delta(router_after, router_before, "pagedkv_router:disagg_requests_total"),
            "fallbacks": {k: v for k, v in fallbacks.items() if v},
            "direct": delta(router_after, router_before, "pagedkv_router:disagg_direct_requests_total"),
            "prefill_s_sum": delta(router_after, router_before, "pagedkv_router:prefill_seconds_sum"),
            "prefill_count": delta(router_after, router_before, "pagedkv_router:prefill_seconds_count"),
            "kv_loads_ok": delta(dec_a, dec_b, "pagedkv:kv_loads_ok_total"),
            "kv_loads_failed": delta(dec_a, dec_b, "pagedkv:kv_loads_failed_total"),
            "kv_blocks_pulled": delta(dec_a, dec_b, "pagedkv:kv_blocks_pulled_total"),
            "kv_transfer_seconds": delta(dec_a, dec_b, "pagedkv:kv_transfer_seconds_total"),
            "leases_granted": delta(pre_a, pre_b, "pagedkv:kv_leases_granted_total"),
            "leases_expired": delta(pre_a, pre_b, "pagedkv:kv_leases_expired_total"),
            "decode_prefix_hits": delta(dec_a, dec_b, "vllm:prefix_cache_hits_total"),
            "decode_prefix_queries": delta(dec_a, dec_b, "vllm:prefix_cache_queries_total"),
        }
        out["disagg"] = disagg
        checks["fallbacks"] = int(sum(disagg["fallbacks"].values()))
        checks["kv_loads_failed"] = int(disagg["kv_loads_failed"])
        checks["leases_expired"] = int(disagg["leases_expired"])
        checks["disagg_requests_not_completed"] = int(disagg["disagg_requests"] != len(ok))
        checks["not_decoded_on_decode_engine"] = len(ok) - per_engine["decode"]
    if any(checks.values()):
        errs = [f"request {r.index}: {r.error}" for r in results if r.error][:5]
        problems.append(f"{name} (round {round_no}): checks {checks}; errors {errs}")
    return out


# ----------------------------------------------------------------------------- report


RATIO_KEYS = ("ttft_p50", "ttft_p99", "e2e_p50", "output_tok_s", "req_s", "cpu_s_engines")


def means(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per deployment (in first-run order), the mean over its rounds of the ratio table's keys."""
    names = list(dict.fromkeys(r["deployment"] for r in runs))
    return {n: {k: float(np.mean([r[k] for r in runs if r["deployment"] == n])) for k in RATIO_KEYS} for n in names}


def tables(runs: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(main table, ratios vs colocated, disaggregated KV transfer)."""
    rows = [
        [
            r["round"],
            r["deployment"],
            r["layout"],
            f"{r['completed']}/{r['requests']}",
            r["ttft_p50"],
            r["ttft_p99"],
            r["e2e_p50"],
            r["output_tok_s"],
            r["req_s"],
            r["seconds"],
            f"{100 * r['engine_hit_rate']:.1f}%",
            f"{100 * r['hit_rate']:.1f}%",
            " / ".join(str(n) for n in r["requests_per_engine"].values()),
            int(r["preemptions"]),
            f"{r['cpu_s_engines']:.1f} / {r['cpu_s_router']:.1f} / {r['cpu_s_client']:.1f}",
            round(r["cpu_s_others"], 1),
            f"{sum(r['idle_cores'].values()):.2f}",
        ]
        for r in runs
    ]
    headers = [
        "round",
        "deployment",
        "processes x threads",
        "requests done",
        "TTFT p50 s",
        "TTFT p99 s",
        "E2E p50 s",
        "output tok/s",
        "req/s",
        "seconds",
        "prefix hit rate (prefilling engines)",
        "usage cached / prompt",
        "requests per engine",
        "preemptions",
        "CPU s engines / router / client",
        "other jobs' CPU s",
        "idle CPU (cores)",
    ]
    main = md_table(headers, rows)
    mean = means(runs)
    base = mean.get(BASELINE)
    ratios = ""
    if base is not None:
        ratio_rows = [[n, *(f"{m[k] / base[k]:.2f}x" for k in RATIO_KEYS)] for n, m in mean.items()]
        ratio_headers = ["deployment", "TTFT p50", "TTFT p99", "E2E p50", "output tok/s", "req/s", "engine CPU s"]
        ratios = md_table(ratio_headers, ratio_rows)
    transfer_rows = []
    for r in runs:
        d = r.get("disagg")
        if d is None:
            continue
        loads = d["kv_loads_ok"]
        transfer_rows.append(
            [
                r["round"],
                r["deployment"],
                d["transport"],
                int(d["disagg_requests"]),
                int(sum(d["fallbacks"].values())),
                f"{int(loads)} / {int(d['kv_loads_failed'])}",
                int(d["kv_blocks_pulled"]),
                d["kv_transfer_seconds"],
                1000 * d["kv_transfer_seconds"] / loads if loads else float("nan"),
                d["prefill_s_sum"] / d["prefill_count"] if d["prefill_count"] else float("nan"),
                f"{100 * d['decode_prefix_hits'] / d['decode_prefix_queries']:.1f}%"
                if d["decode_prefix_queries"]
                else "n/a",
                f"{int(d['leases_granted'])} / {int(d['leases_expired'])}",
            ]
        )
    transfer = ""
    if transfer_rows:
        transfer = md_table(
            [
                "round",
                "deployment",
                "transport",
                "disagg requests",
                "fallbacks",
                "KV loads ok / failed",
                "blocks pulled",
                "transfer s (sum)",
                "ms per load",
                "prefill s mean (router)",
                "decode engine's local prefix hit rate",
                "leases granted / expired",
            ],
            transfer_rows,
        )
    return main, ratios, transfer


def summary(runs: list[dict[str, Any]]) -> str:
    """Each deployment's means against the baseline's, and each disaggregated run's transfer."""
    mean = means(runs)
    base = mean.get(BASELINE)
    parts = []
    for n, m in mean.items():
        s = f"`{n}` TTFT p50 {m['ttft_p50']:.3f} s, {m['output_tok_s']:.1f} output tok/s"
        if base is not None and n != BASELINE:
            s += f" ({m['ttft_p50'] / base['ttft_p50']:.2f}x, {m['output_tok_s'] / base['output_tok_s']:.2f}x)"
        parts.append(s)
    text = f"Means over rounds, against `{BASELINE}`: " + "; ".join(parts) + "."
    for r in (r for r in runs if "disagg" in r):
        d = r["disagg"]
        loads = d["kv_loads_ok"]
        text += (
            f" `{r['deployment']}` round {r['round']}: {int(d['disagg_requests'])} requests prefilled remotely, "
            f"{int(sum(d['fallbacks'].values()))} fallbacks, {int(loads)} pulls ({int(d['kv_loads_failed'])} failed) "
            f"of {int(d['kv_blocks_pulled'])} blocks, "
            + (f"{1000 * d['kv_transfer_seconds'] / loads:.1f} ms per pull" if loads else "no pull")
            + (
                f" vs {1000 * d['prefill_s_sum'] / d['prefill_count']:.0f} ms per prefill request."
                if d["prefill_count"]
                else "."
            )
        )
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=4, help="distinct system prompts")
    ap.add_argument("--prompt-blocks", type=int, default=8, help="KV blocks per system prompt")
    ap.add_argument("--zipf-s", type=float, default=0.0, help="system prompt popularity (0: uniform)")
    ap.add_argument("--max-question", type=int, default=128, help="longest ShareGPT question (tokens)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=192, help="KV pool of every engine")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="per engine (default: --concurrency)")
    ap.add_argument("--kv-transport", choices=("auto", "nixl", "gloo"), default="auto")
    ap.add_argument(
        "--deployments",
        default=",".join(DEFAULT_DEPLOYMENTS),
        help=f"comma-separated, in order, of {', '.join(DEPLOYMENTS)} (disagg: over --kv-transport)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every deployment, the order reversed each round")
    ap.add_argument("--max-minutes", type=float, default=12.0, help="skip later runs past this budget")
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle CPU measured after the warm-up")
    ap.add_argument("--run-cap", type=float, default=240.0, help="wall-clock cap of one deployment's load (seconds)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a deployment to become healthy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, short prompts, no RESULTS.md")
    add_write_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.num_prompts, args.prompt_blocks, args.max_question = 8, 2, 4, 32
        args.max_tokens, args.concurrency, args.num_blocks, args.run_cap, args.no_write = 8, 4, 64, 60.0, True
        args.rounds = 1
    names = [n.strip() for n in args.deployments.split(",") if n.strip()]
    if unknown := sorted(set(names) - set(DEPLOYMENTS)):
        raise SystemExit(f"unknown deployment(s) {unknown}; known: {DEPLOYMENTS}")
    if args.kv_transport == "auto":
        from pagedkv.distributed.kv_transport import nixl_available

        args.kv_transport = "nixl" if nixl_available() else "gloo"
        args.kv_transport_resolved_from_auto = "disagg" in names
    # "disagg" is the one over --kv-transport; each transport runs once.
    names = list(dict.fromkeys(f"disagg-{args.kv_transport}" if n == "disagg" else n for n in names))
    args.max_num_seqs = args.max_num_seqs or args.concurrency
    seq_blocks = args.prompt_blocks + -(-(args.max_question + args.max_tokens) // args.block_size)
    args.max_model_len = seq_blocks * args.block_size
    need = args.num_prompts * args.prompt_blocks + args.concurrency * (seq_blocks - args.prompt_blocks)
    t_start = time.perf_counter()

    reqs = build_requests(args)
    n_prompt = sum(len(r.prompt) for r in reqs)
    mean_q = float(np.mean([r.question_len for r in reqs]))
    print(
        f"{len(reqs)} requests, {n_prompt} prompt tokens; {args.num_prompts} system prompts x {args.prompt_blocks} "
        f"blocks; pool {args.num_blocks} blocks per engine (all system prompts + {args.concurrency} sequences in "
        f"flight: {need}); max_model_len {args.max_model_len}",
        flush=True,
    )
    if args.num_blocks < need:
        print("note: the pool cannot hold every system prompt and the requests in flight", flush=True)

    problems: list[str] = []
    runs: list[dict[str, Any]] = []
    schedule = [(k, n) for k in range(1, args.rounds + 1) for n in (names if k % 2 else names[::-1])]
    skipped = 0
    for i, (round_no, name) in enumerate(schedule):
        if runs:
            elapsed = time.perf_counter() - t_start
            per_run = max(r["seconds"] + r["start_s"] for r in runs) + args.idle_s + 15
            if elapsed + 1.2 * per_run > 60 * args.max_minutes:
                skipped = len(schedule) - i
                print(f"skipping {skipped} run(s): {elapsed:.0f} s spent, ~{per_run:.0f} s per run", flush=True)
                break
        try:
            r = run_deployment(name, round_no, args, reqs, problems)
        except Exception as exc:  # noqa: BLE001 - reported; the other deployments still run
            problems.append(f"{name} (round {round_no}): failed: {type(exc).__name__}: {exc}")
            print(f"  {name}: FAILED: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
            continue
        runs.append(r)
        line = (
            f"  round {round_no} {name:21s} ({r['layout']}): up in {r['start_s']:.1f} s; {r['completed']}/{r['requests']} done, TTFT "
            f"p50 {r['ttft_p50']:.3f} s p99 {r['ttft_p99']:.3f} s, E2E p50 {r['e2e_p50']:.2f} s, "
            f"{r['output_tok_s']:.1f} out tok/s, {r['req_s']:.2f} req/s, hit rate {100 * r['engine_hit_rate']:.1f}%, "
            f"CPU s engines {r['cpu_s_engines']:.1f}, others {r['cpu_s_others']:.1f}"
        )
        if "disagg" in r:
            line += f"\n    {json.dumps(r['disagg'])}"
        print(line, flush=True)
    total_s = time.perf_counter() - t_start
    if not runs:
        raise SystemExit("no deployment ran:\n" + "\n".join(problems))

    main_table, ratio_table, transfer_table = tables(runs)
    desc = (
        f"{len(reqs)} requests (seed {args.seed}), the routing benchmark's workload: {args.num_prompts} system prompts "
        f"of {args.prompt_blocks} blocks x {args.block_size} tokens (synthetic token ids, zipf_s {args.zipf_s:g}), "
        f"each followed by a ShareGPT first-turn question (<= {args.max_question} tokens, mean {mean_q:.0f}): "
        f"{n_prompt} prompt tokens, sent as token ids; `max_tokens` {args.max_tokens}, `ignore_eos`, greedy, "
        f"streaming `/v1/completions`, {args.concurrency} in flight, the same requests and `cache_salt` for every "
        f"deployment. Every engine: embedded SmolLM2-135M-Instruct, float32, CPU, {args.num_blocks} KV blocks of "
        f"{args.block_size} tokens, max_model_len {args.max_model_len}, max_num_seqs {args.max_num_seqs}; one "
        f"thread (`OMP_NUM_THREADS=1`) except `colocated-2t`; the replicas also publish KV events (the cache-aware "
        f"router follows them). Each deployment is started fresh (empty caches), warmed up with two small requests "
        f"per engine and through its router, measured, and stopped; {args.rounds} round(s), the order reversed every other round; the client (httpx, this process) and every "
        f"process share the machine's {os.cpu_count()} cores. `disagg` = `start_disagg` (prefill engine, decode "
        f"engine, `pagedkv router --prefill --decode`) over the named KV transport"
        + (
            f" (`disagg` in `--deployments` = `--kv-transport auto`, which chose {args.kv_transport})."
            if getattr(args, "kv_transport_resolved_from_auto", False)
            else "."
        )
    )
    defs = (
        "TTFT = first streamed token chunk - send (through the router where there is one); E2E = last chunk - send; "
        "output tok/s and req/s from the first send to the last token. Prefix hit rate = `vllm:prefix_cache_hits / "
        "vllm:prefix_cache_queries` over the run on the engines that prefill (the engine, both replicas, or the "
        "prefill engine); usage cached / prompt = the answers' `cached_tokens / prompt_tokens` (for `disagg` the "
        "decode engine's answer, which counts the pulled blocks as cached). Requests per engine from "
        "`x-pagedkv-replica` (for `disagg`: prefill / decode, the prefills counted by the router). Idle CPU = the "
        "deployment's processes' CPU seconds per second over the idle seconds after the warm-up. CPU s: the engines', the router's "
        "and the client's during the run; other jobs' CPU s: the machine's busy time less those. KV transfer: the "
        "decode engine's `pagedkv:kv_loads_ok / kv_loads_failed / kv_blocks_pulled / kv_transfer_seconds` (a pull "
        "covers only the prompt's full blocks not already cached on the decode engine; a request whose blocks are "
        "all cached there pulls nothing), the prefill engine's `kv_leases_granted / expired`, the router's "
        "`disagg_requests_total`, `disagg_fallbacks_total` and `prefill_seconds` (its mean: send to 200 of the "
        "one-token prefill request)."
    )
    if skipped:
        problems.append(f"{skipped} run(s) skipped for the {args.max_minutes:g}-minute budget")
    notes = "\n".join(f"- {p}" for p in problems) if problems else "- none"
    print(desc)
    print(main_table)
    print(ratio_table)
    print(transfer_table)
    print(summary(runs))
    print(f"Problems / checks:\n{notes}")
    print(f"Benchmark run time: {total_s:.0f} s")
    if args.no_write:
        return
    command = ("python benches/bench_disagg.py " + " ".join(sys.argv[1:])).strip()
    checks = (
        "Checks on every response: streamed to `[DONE]` with a usage chunk, completion_tokens = max_tokens = token "
        "chunks received, prompt_tokens = the ids sent; for `disagg`: 0 fallbacks, 0 failed pulls, 0 expired "
        "leases, one disaggregated request per completed request, every answer from the decode engine. Problems:\n"
        + notes
    )
    body = (
        f"{desc}\n\n{main_table}\n\nRatios vs `{BASELINE}` (1 engine x 1 thread):\n\n{ratio_table}\n\n"
        f"KV transfer (`disagg`):\n\n{transfer_table}\n\n{defs}\n\n"
        f"{summary(runs)}\n\n{checks}\n\nBenchmark run time: {total_s:.0f} s."
    )
    write_section(SECTION, command, body, HEADING)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    data = {
        "command": command,
        "machine": machine(),
        "commit": git_rev(),
        "config": vars(args),
        "requests": {"count": len(reqs), "prompt_tokens": n_prompt, "question_lens": [r.question_len for r in reqs]},
        "runs": runs,
        "problems": problems,
        "run_time_s": total_s,
    }
    (RESULTS_DIR / "disagg.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote benches/results/disagg.json and the '{SECTION}' section of benches/RESULTS.md")


if __name__ == "__main__":
    main()
