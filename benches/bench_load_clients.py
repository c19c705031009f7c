"""guidellm and aiperf, the load generators vLLM users benchmark with, against `pagedkv serve`:
their throughput figures next to bench_serve's client on the same ShareGPT requests.

One server (the embedded SmolLM2, float32, CPU, bench_serve's engine arguments) serves, in
turn, at each concurrency (default 1 and 16): bench_serve's own load generator
(``openai.AsyncOpenAI``, streaming, in this process), ``guidellm run`` and ``aiperf profile``
(each its CLI in a subprocess, in its own process group). All three send the same requests —
the first ``--num-requests`` ShareGPT first turns that bench_serve uses (seeded), the prompt as
text to ``/v1/completions``, streaming, ``max_tokens`` = the recorded reply's length capped at
``--max-output``, ``ignore_eos`` (guidellm sends it itself when a row has an output token count;
aiperf gets it with ``--extra-inputs``, and ``min_tokens`` per row) — and each run its own
``cache_salt``, so no run reuses another's prefix cache. Figures are each tool's own: request
and output-token throughput over its run, TTFT and ITL medians; every run is checked (every
request succeeded, each reply has exactly ``max_tokens`` tokens, prompt tokens = the loader's).

The module also holds what ``tests/serving/test_clients_load.py`` shares with it: running a tool's CLI
bounded in its own process group, the offline tokenizer for aiperf, each tool's configuration
and report reader.

    python benches/bench_load_clients.py [--num-requests 32] [--requests-at-1 8] [--concurrency 1,16] [--rounds 2] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SECTION = "load-clients"
# guidellm spawns up to 10 worker processes by default, each re-importing torch (its data
# loader): tens of seconds of start-up on a small machine for a load one process drives easily.
GUIDELLM_ENV = {"GUIDELLM__MAX_WORKER_PROCESSES": "1"}
# aiperf's offline mode loads tokenizers only from the Hugging Face hub cache (a folder path
# fails there), and outside it every run first "prefetches" the tokenizer in a subprocess.
# So aiperf gets a hub-cache entry of this name whose snapshot is the tokenizer folder.
AIPERF_TOKENIZER_REPO = "pagedkv-local/tokenizer"
_SNAPSHOT = "0" * 40  # the entry's one "commit"


def cli_path(name: str) -> Path:
    """The console script ``name`` installed beside this Python (the venv's bin folder)."""
    return Path(sys.executable).parent / name


# ----------------------------------------------------------------------------- running a CLI


@dataclass
class CliRun:
    """One finished (or killed) CLI run: exit status, its output, wall and CPU seconds (the
    tool's processes, all of its descendants that were waited for)."""

    argv: list[str]
    returncode: int
    output: str
    wall_s: float
    cpu_s: float
    timed_out: bool

    def tail(self, num_chars: int = 4000) -> str:
        return self.output[-num_chars:]


def run_cli(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> CliRun:
    """Runs ``argv`` in its own session (process group) with stdout and stderr in one log file
    under ``cwd``; after ``timeout`` seconds the whole group is killed. The group is killed once
    the tool exits too, so no helper process it started outlives the run: before the tool is
    reaped, so its pid (the group's id) cannot have been reused by then."""
    log = cwd / f"{Path(argv[0]).name}-{time.monotonic_ns()}.log"
    cpu0 = _children_cpu_s()
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = not _wait_unreaped(proc.pid, timeout)
        _kill_group(proc.pid)
        proc.wait(30)
    wall = time.perf_counter() - t0
    return CliRun(
        argv,
        proc.returncode,
        log.read_text(errors="replace"),
        wall,
        _children_cpu_s() - cpu0,
        timed_out,
    )


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Whether child ``pid`` exited within ``timeout`` seconds; it is left a zombie (not reaped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.1)
    return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone: the tool and everything it started have exited


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ----------------------------------------------------------------------------- the tools


def aiperf_tokenizer_cache(root: Path, tokenizer_dir: Path) -> dict[str, str]:
    """A Hugging Face hub cache under ``root`` holding ``tokenizer_dir``'s files (links) as
    :data:`AIPERF_TOKENIZER_REPO`; returns the environment that makes aiperf load it offline."""
    repo = root / ("models--" + AIPERF_TOKENIZER_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / _SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOT)
    for src in tokenizer_dir.iterdir():
        dst = snapshot / src.name
        if src.is_file() and src.suffix != ".safetensors" and not dst.exists():
            dst.symlink_to(src.resolve())
    return {"HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1"}


@contextlib.contextmanager
def aiperf_tmpdir() -> Iterator[dict[str, str]]:
    """``TMPDIR`` for one aiperf run: a new folder directly under the system's temp folder,
    removed afterwards. aiperf binds its ZMQ IPC sockets (and writes its dataset memory maps)
    there; a Unix socket path holds at most 107 bytes, which one under a deep folder such as
    pytest's ``tmp_path`` exceeds — and aiperf then exits with status 0 having sent nothing."""
    with tempfile.TemporaryDirectory(prefix="aiperf-") as folder:
        yield {"TMPDIR": folder}


def guidellm_scenario(
    *,
    url: str,
    model: str,
    tokenizer: str,
    profile: dict[str, Any],
    data: dict[str, Any],
    max_requests: int,
    report: Path,
    body_extras: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``guidellm run --scenario`` file: streaming ``/v1/completions`` at ``url``, stopping
    after ``max_requests``, its JSON report at ``report``. The data loader prepares only as many
    rows as are sent (its default prefetches 4096)."""
    backend: dict[str, Any] = {
        "kind": "openai_http",
        "target": url,
        "model": model,
        "request_format": "/v1/completions",
    }
    if body_extras:
        backend["extras"] = {"body": body_extras}
    return {
        "spec": {
            "backend": backend,
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
            "profile": profile,
            "data": [data],
            "data_loader": {"kind": "pytorch", "samples": max_requests, "prefetch_factor": max_requests},
            "constraints": [{"kind": "max_requests", "count": max_requests}],
            "outputs": [{"kind": "json", "path": str(report)}],
            "seed": {"kind": "static", "value": 0},
        }
    }


def guidellm_argv(scenario: Path) -> list[str]:
    return [str(cli_path("guidellm")), "run", "--scenario", str(scenario), "--disable-progress"]


def aiperf_argv(
    *,
    url: str,
    model: str,
    artifact_dir: Path,
    request_count: int,
    load: list[str],
    data: list[str],
    extra_inputs: dict[str, str],
) -> list[str]:
    """``aiperf profile`` on streaming ``/v1/completions``: token counts as the server reports
    them (usage), one worker and one record processor (the machine is small), no dashboard,
    plots or GPU / server-metrics collection. ``load``: the load flags (rate or concurrency);
    ``data``: the dataset flags; ``extra_inputs``: fields added to every request body."""
    argv = [
        str(cli_path("aiperf")), "profile", "--model", model, "--tokenizer", AIPERF_TOKENIZER_REPO, "--url", url,
        "--endpoint-type", "completions", "--streaming", "--use-server-token-count",
        "--request-count", str(request_count), "--random-seed", "0", "--output-artifact-dir", str(artifact_dir),
        "--ui-type", "none", "--no-auto-plot", "--no-server-metrics", "--no-gpu-telemetry",
        "--workers-max", "1", "--record-processor-service-count", "1", *load, *data,
    ]  # fmt: skip
    for name, value in extra_inputs.items():
        argv += ["--extra-inputs", f"{name}:{value}"]
    return argv


@dataclass
class LoadReport:
    """What a load generator's report says about one run: request outcomes, per-request token
    counts (as the server's usage reported them), and its throughput and latency figures."""

    tool: str
    succeeded: int
    failed: int
    incomplete: int
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    seconds: float = float("nan")
    req_s: float = float("nan")
    output_tok_s: float = float("nan")
    ttft_p50_ms: float = float("nan")
    itl_p50_ms: float = float("nan")
    errors: list[str] = field(default_factory=list)
    # bench_serve's client checks each response's usage itself and reports only the counts of
    # mismatches (its `usage_problems`); the tools' reports give the token counts.
    usage_problems: dict[str, int] | None = None
    # Requests the tool had sent but not yet recorded when it wrote its report: guidellm's
    # scheduler can stop with the last response still "processing" (on a busy machine); the
    # server answered it all the same. 0 for the other clients.
    unrecorded: int = 0


def read_guidellm_report(path: Path) -> LoadReport:
    """guidellm's JSON report of a run with one benchmark."""
    (bench,) = json.loads(path.read_text())["benchmarks"]
    requests, metrics = bench["requests"], bench["metrics"]
    ok = requests["successful"]
    return LoadReport(
        tool="guidellm",
        succeeded=len(ok),
        failed=len(requests["errored"]),
        incomplete=len(requests["incomplete"]),
        prompt_tokens=[r["input_metrics"]["text_tokens"] for r in ok],
        output_tokens=[r["output_metrics"]["text_tokens"] for r in ok],
        seconds=bench["duration"],
        req_s=metrics["requests_per_second"]["successful"]["mean"],
        output_tok_s=metrics["output_tokens_per_second"]["successful"]["mean"],
        ttft_p50_ms=metrics["time_to_first_token_ms"]["successful"]["median"],
        itl_p50_ms=metrics["inter_token_latency_ms"]["successful"]["median"],
        errors=[str(r["info"].get("error")) for r in requests["errored"]][:5],
        unrecorded=int(bench.get("scheduler_state", {}).get("processing_requests", 0)),
    )


def read_aiperf_report(artifact_dir: Path) -> LoadReport:
    """aiperf's summary (``profile_export_aiperf.json``) and per-request records
    (``profile_export.jsonl``, one line per request, an ``error`` on a failed one)."""
    summary = json.loads((artifact_dir / "profile_export_aiperf.json").read_text())
    lines = (artifact_dir / "profile_export.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    ok = [r for r in records if not r.get("error") and not r["metadata"].get("was_cancelled")]

    def metric(record: dict[str, Any], name: str) -> int:
        return int(record["metrics"][name]["value"])

    def stat(name: str, key: str) -> float:
        return float(summary[name][key]) if name in summary else float("nan")

    return LoadReport(
        tool="aiperf",
        succeeded=len(ok),
        failed=sum(bool(r.get("error")) for r in records),
        incomplete=sum(bool(r["metadata"].get("was_cancelled")) for r in records),
        prompt_tokens=[metric(r, "usage_prompt_tokens") for r in ok],
        output_tokens=[metric(r, "usage_completion_tokens") for r in ok],
        seconds=stat("benchmark_duration", "avg"),
        req_s=stat("request_throughput", "avg"),
        output_tok_s=stat("output_token_throughput", "avg"),
        ttft_p50_ms=stat("time_to_first_token", "p50"),
        itl_p50_ms=stat("inter_token_latency", "p50"),
        errors=[json.dumps(e)[:300] for e in summary.get("error_summary") or []][:5],
    )


# ----------------------------------------------------------------------------- the benchmark


def _check(report: LoadReport, prompt_lens: list[int], output_lens: list[int]) -> list[str]:
    """What is wrong with a run whose requests had these token counts (order-insensitive: the
    tools report requests in completion order)."""
    problems = []
    if report.failed or report.incomplete or report.succeeded != len(output_lens):
        problems.append(
            f"{report.succeeded}/{len(output_lens)} succeeded, {report.failed} failed, {report.incomplete} "
            f"incomplete {report.errors}"
        )
    if report.usage_problems is not None:
        problems += [f"{name}: {count}" for name, count in report.usage_problems.items() if count]
        return problems
    if sorted(report.output_tokens) != sorted(output_lens):
        problems.append("output token counts != max_tokens")
    if sorted(report.prompt_tokens) != sorted(prompt_lens):
        problems.append("prompt token counts != the loader's")
    return problems


def _tool_run(name: str, run: CliRun, read: Callable[[Path], LoadReport], where: Path) -> LoadReport:
    if run.returncode != 0:
        raise RuntimeError(f"{name} exited with {run.returncode} (timed out: {run.timed_out}):\n{run.tail()}")
    return read(where)


def run_guidellm(work: Path, url: str, model: str, tokenizer: Path, reqs: list[Any], concurrency: int) -> LoadReport:
    rows = work / "guidellm-requests.jsonl"
    rows.write_text("".join(json.dumps({"prompt": r.prompt, "output_tokens_count": r.output_len}) + "\n" for r in reqs))
    report = work / f"guidellm-c{concurrency}.json"
    scenario = guidellm_scenario(
        url=url,
        model=model,
        tokenizer=str(tokenizer),
        profile={"kind": "concurrent", "streams": [concurrency]},
        data={"kind": "json_file", "path": str(rows)},
        max_requests=len(reqs),
        report=report,
        body_extras={"cache_salt": f"guidellm-c{concurrency}-{time.time_ns()}"},
    )
    path = work / f"guidellm-c{concurrency}-scenario.json"
    path.write_text(json.dumps(scenario, indent=1))
    run = run_cli(guidellm_argv(path), cwd=work, env={"HF_HUB_OFFLINE": "1", **GUIDELLM_ENV}, timeout=1800)
    return _tool_run("guidellm", run, read_guidellm_report, report)


def run_aiperf(
    work: Path, url: str, model: str, hub_env: dict[str, str], reqs: list[Any], concurrency: int
) -> LoadReport:
    rows = work / "aiperf-requests.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"text": r.prompt, "output_length": r.output_len, "extra": {"min_tokens": r.output_len}}) + "\n"
            for r in reqs
        )
    )
    artifacts = work / f"aiperf-c{concurrency}"
    argv = aiperf_argv(
        url=url,
        model=model,
        artifact_dir=artifacts,
        request_count=len(reqs),
        load=["--concurrency", str(concurrency)],
        data=[
            "--input-file",
            str(rows),
            "--custom-dataset-type",
            "single_turn",
            "--dataset-sampling-strategy",
            "sequential",
        ],
        extra_inputs={"ignore_eos": "true", "cache_salt": f"aiperf-c{concurrency}-{time.time_ns()}"},
    )
    with aiperf_tmpdir() as tmp_env:
        run = run_cli(argv, cwd=work, env={**hub_env, **tmp_env}, timeout=1800)
    return _tool_run("aiperf", run, read_aiperf_report, artifacts)


def run_bench_serve_client(server: Any, model: str, reqs: list[Any], concurrency: int) -> LoadReport:
    """bench_serve's own load generator (``openai.AsyncOpenAI``), as its saturation run drives it."""
    from bench_serve import run_load

    r = run_load(
        server, model, reqs, label=f"bench_serve-c{concurrency}-{time.time_ns()}", rate=None,
        concurrency=concurrency, cap_s=1800, seed=0,
    )  # fmt: skip
    return LoadReport(
        tool="bench_serve",
        succeeded=r["completed"],
        failed=r["failed"],
        incomplete=r["cut_by_cap"],
        seconds=r["seconds"],
        req_s=r["req_s"],
        output_tok_s=r["output_tok_s"],
        ttft_p50_ms=1000 * r["ttft_p50"],
        itl_p50_ms=1000 * r["itl_p50"],
        errors=r["errors"],
        usage_problems=r["usage_problems"],
    )


TOOLS = ("bench_serve", "guidellm", "aiperf")


@dataclass
class Session:
    """What every run of one benchmark shares: the server, its model name, the work folder."""

    server: Any
    model: str
    tokenizer: Path
    work: Path
    hub_env: dict[str, str]


def measured_run(session: Session, name: str, reqs: list[Any], concurrency: int) -> tuple[LoadReport, dict[str, float]]:
    """One tool's run, with the wall time including its start-up and the CPU seconds of the
    server, of the tool (its processes, or this one for bench_serve's client) and of the rest
    of the machine (other jobs) over it."""
    from _results import cpu_seconds_machine, cpu_seconds_pid

    pid = session.server.process.pid
    s0, c0, m0, t0 = cpu_seconds_pid(pid), _children_cpu_s() + _self_cpu_s(), cpu_seconds_machine(), time.perf_counter()
    if name == "bench_serve":
        rep = run_bench_serve_client(session.server, session.model, reqs, concurrency)
    elif name == "guidellm":
        rep = run_guidellm(session.work, session.server.url, session.model, session.tokenizer, reqs, concurrency)
    else:
        rep = run_aiperf(session.work, session.server.url, session.model, session.hub_env, reqs, concurrency)
    wall = time.perf_counter() - t0
    server_cpu, tool_cpu = cpu_seconds_pid(pid) - s0, _children_cpu_s() + _self_cpu_s() - c0
    others = max(0.0, cpu_seconds_machine() - m0 - server_cpu - tool_cpu)  # clock ticks can round below 0
    return rep, {"wall_s": wall, "server_cpu_s": server_cpu, "tool_cpu_s": tool_cpu, "others_cpu_s": others}


def _self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def ratio_lines(rows: list[dict[str, Any]], concurrencies: list[int]) -> list[str]:
    """Each tool's output tok/s over bench_serve's at each concurrency: of the means over the
    rounds, and per round."""

    def tps(concurrency: int, tool: str) -> list[float]:
        return [r["output_tok_s"] for r in rows if r["concurrency"] == concurrency and r["tool"] == tool]

    lines = []
    for c in concurrencies:
        base = tps(c, "bench_serve")
        for tool in TOOLS[1:]:
            mine = tps(c, tool)
            per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(mine, base))
            lines.append(
                f"{tool} / bench_serve at concurrency {c}: {sum(mine) / sum(base):.2f} (per round {per_round})"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32, help="ShareGPT requests per run (concurrency > 1)")
    ap.add_argument("--requests-at-1", type=int, default=8, help="the first N of them in the concurrency-1 runs")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated concurrencies (one run per tool each)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every run; even rounds run the tools in reverse")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument(
        "--max-output", type=int, default=64, help="cap on the recorded reply lengths (max_tokens; bench_serve: 128)"
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", type=Path, default=None, help="where the tools' reports go (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 short requests, concurrency 2, one round")
    from _results import add_write_flag, machine, md_table, write_section

    add_write_flag(ap)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.concurrency, args.max_output, args.rounds, args.no_write = 4, "2", 16, 1, True
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import httpx
    from bench_serve import engine_args, load_requests, server_argv

    from pagedkv.server.launch import ServerProcess
    from pagedkv.worker.model_files import default_model_dir

    args.num_blocks = args.max_num_seqs * -(-args.max_model_len // 16) + 16
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    all_reqs = load_requests(args.num_requests, args.max_prompt, args.max_output, args.seed)
    eargs = engine_args(args)
    scratch = tempfile.TemporaryDirectory(prefix="bench-load-clients-")  # removed at the end
    work = args.work_dir or Path(scratch.name)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = default_model_dir()
    hub_env = aiperf_tokenizer_cache(work / "hub", tokenizer)
    print(f"{len(all_reqs)} requests; work dir {work}", flush=True)
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    with ServerProcess(server_argv(eargs), start_timeout=600) as server:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        session = Session(server, model, tokenizer, work, hub_env)
        run_bench_serve_client(server, model, all_reqs[:2], 2)  # warm-up (first-call costs)
        for round_no in range(1, args.rounds + 1):
            order = TOOLS if round_no % 2 else TOOLS[::-1]
            for c in concurrencies:
                reqs = all_reqs[: args.requests_at_1] if c == 1 else all_reqs
                for name in order:
                    print(f"round {round_no}, concurrency {c}: {name} ...", flush=True)
                    rep, cost = measured_run(session, name, reqs, c)
                    lens = ([r.prompt_len for r in reqs], [r.output_len for r in reqs])
                    problems += [f"{name}, round {round_no}, concurrency {c}: {p}" for p in _check(rep, *lens)]
                    rows.append({"round": round_no, "concurrency": c, "tool": name, "requests": len(reqs), **cost})
                    rows[-1].update(vars(rep))
                    print(f"  {rep.output_tok_s:.1f} output tok/s ({cost['wall_s']:.0f} s with start-up)", flush=True)
    total_s = time.perf_counter() - t_start
    rows.sort(key=lambda r: (r["concurrency"], r["round"], TOOLS.index(r["tool"])))
    headers = [
        "concurrency", "round", "load generator", "requests ok", "seconds (tool's)", "req/s", "output tok/s",
        "TTFT p50 ms", "ITL p50 ms", "wall s incl. start-up", "CPU s server / tool", "other jobs' CPU s",
    ]  # fmt: skip
    table = md_table(
        headers,
        [
            [
                r["concurrency"],
                r["round"],
                r["tool"],
                f"{r['succeeded']}/{r['requests']}",
                r["seconds"],
                r["req_s"],
                r["output_tok_s"],
                r["ttft_p50_ms"],
                r["itl_p50_ms"],
                r["wall_s"],
                f"{r['server_cpu_s']:.0f} / {r['tool_cpu_s']:.0f}",
                round(r["others_cpu_s"]),
            ]  # fmt: skip
            for r in rows
        ],
    )
    n_at_1 = min(args.requests_at_1, len(all_reqs))
    desc = (
        f"The first {len(all_reqs)} ShareGPT first turns of bench_serve (seed {args.seed}; prompt <= {args.max_prompt} "
        f"tokens, replies capped at {args.max_output}: {sum(r.prompt_len for r in all_reqs)} prompt / "
        f"{sum(r.output_len for r in all_reqs)} output tokens; the concurrency-1 runs send the first {n_at_1}), text "
        f"prompts on streaming `/v1/completions`, `max_tokens` = the reply's length, `ignore_eos` (aiperf: and "
        f"`min_tokens`), each run its own `cache_salt`. One `pagedkv serve` (embedded SmolLM2-135M-Instruct, float32, "
        f"CPU, engine arguments {eargs}) driven in turn by bench_serve's client (`openai.AsyncOpenAI` in the bench's "
        f"process, as bench_serve's saturation run), guidellm (`guidellm run`, profile `concurrent`, one worker "
        f"process) and aiperf (`aiperf profile --concurrency`, one worker, token counts from the server's usage), each "
        f"tool as its CLI; {args.rounds} rounds, the tools in reverse order in even rounds. Each tool's own figures: "
        f"seconds = its run's duration, req/s and output tok/s over it, TTFT and ITL medians; then the run's wall time "
        f"with the tool's start-up, the CPU seconds of the server and of the tool's processes, and the rest of the "
        f"machine's busy CPU seconds (/proc/stat) over it. Checks on every run: every request succeeded, output tokens "
        f"= `max_tokens` and prompt tokens = the loader's count for each request. The machine (2 cores) is shared with "
        f"3 other agents' jobs: absolute figures move with their load (the last column); the ratios between tools "
        f"measured side by side are what this records."
    )
    scratch.cleanup()
    verdict = "Output tok/s, tool / bench_serve's client: " + "; ".join(ratio_lines(rows, concurrencies)) + "."
    cores = {
        t: sum(r["tool_cpu_s"] for r in rows if r["tool"] == t) / sum(r["wall_s"] for r in rows if r["tool"] == t)
        for t in TOOLS
    }
    verdict += (
        " The load generators' own CPU over their runs (start-up included), in cores: "
        + ", ".join(f"{t} {c:.2f}" for t, c in cores.items())
        + "; on this 2-core machine what a tool uses is taken from the server."
    )
    notes = "\n".join(f"- {p}" for p in problems) if problems else "- none"
    print(desc, table, verdict, f"Problems:\n{notes}", f"Run time: {total_s:.0f} s", sep="\n\n")
    if args.no_write:
        return
    command = "python benches/bench_load_clients.py " + " ".join(sys.argv[1:])
    body = (
        f"{desc}\n\n{table}\n\n{verdict}\n\nProblems:\n{notes}\n\nBenchmark run time: {total_s:.0f} s on {machine()}."
    )
    write_section(SECTION, command.strip(), body, heading="## Load generators: guidellm and aiperf vs bench_serve")
    print(f"wrote the '{SECTION}' section of benches/RESULTS.md")


if __name__ == "__main__":
    main()
