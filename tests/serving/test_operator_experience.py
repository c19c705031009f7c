"""What an operator meets first: idle tensor-parallel workers,
sizes with units on every command, the benches' opt-in record, clean ``--help`` text, a
core-only install's error, and a tensor-parallel size refused before anything starts.
"""

from __future__ import annotations

import argparse
import ast
import ipaddress
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.parallel.preflight import check_ray_resources

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def _children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets that process ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                hex_ip, hex_port = cols[1].split(":")
                raw = bytes.fromhex(hex_ip)
                if len(raw) == 4:
                    ip = ".".join(str(b) for b in raw[::-1])
                else:  # IPv6: four little-endian 32-bit words
                    ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))).compressed
                found.add((ip, int(hex_port, 16)))
    return found


# ---------------------------------------------------------------- 17: idle workers keep waiting


_IDLE_WORKER = """
import sys, torch
from pagedkv.parallel.group import TPGroup
from pagedkv.parallel.step_broadcast import recv_step
group = TPGroup.create(1, 2, sys.argv[1], torch.device("cpu"), timeout=float(sys.argv[2]))
step = recv_step(group)
print("got", step.input_ids.tolist(), flush=True)
assert recv_step(group) is None
group.close()
"""


def test_a_worker_waits_for_the_next_step_longer_than_the_group_timeout() -> None:
    """The Ray test's flake: its other engine sat idle while the first Ray start on a machine
    took long, its workers' wait for the next step hit the group's 60 s timeout, and they left
    ("worker rank 1 exited", gloo "connection closed by peer" on the next step). Here the worker's
    group timeout is 5 s and rank 0 sends its step 6 s later: the worker must get it."""
    from pagedkv.parallel.group import TPGroup, host_store
    from pagedkv.parallel.step_broadcast import empty_step, send_shutdown, send_step

    before = _listening(os.getpid())
    store, init_method = host_store("127.0.0.1", 2, 120.0)
    worker = subprocess.Popen(
        [PYTHON, "-c", _IDLE_WORKER, init_method, "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        group = TPGroup.create(0, 2, init_method, torch.device("cpu"), 120.0, store=store)
        # A local group listens on loopback only: its store and its gloo pairs.
        opened = _listening(os.getpid()) - before
        assert opened and all(ip in ("127.0.0.1", "::1") for ip, _ in opened), opened
        time.sleep(6.0)  # idle past the worker's group timeout
        step = empty_step()
        step.input_ids = np.array([1, 2, 3])
        send_step(group, step)
        send_shutdown(group)
        out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert "got [1, 2, 3]" in out, (out, err[-2000:])
    assert worker.returncode == 0, (out, err[-2000:])


# ---------------------------------------------------------------- 24: sizes refused before anything starts


def test_a_size_the_heads_do_not_divide_is_refused_before_ray_or_a_worker_starts() -> None:
    ray = pytest.importorskip("ray")
    from pagedkv import LLMEngine

    assert not ray.is_initialized()
    before = set(_children_of(os.getpid()))
    for backend in ("ray", "mp"):
        with pytest.raises(ConfigError, match=r"tensor_parallel_size=8 does not divide the model's attention heads 9"):
            LLMEngine(device="cpu", dtype="float32", tensor_parallel_size=8, distributed_executor_backend=backend)
        assert not ray.is_initialized(), backend
        assert set(_children_of(os.getpid())) <= before, backend


def test_ray_resources_are_checked_per_worker_rank() -> None:
    check_ray_resources({"CPU": 2.0}, 3, on_cuda=False)  # ranks 1 and 2; rank 0 is the driver
    with pytest.raises(ConfigError, match=r"needs 7 CPU for its 7 worker ranks .* the Ray cluster has 2"):
        check_ray_resources({"CPU": 2.0}, 8, on_cuda=False)
    with pytest.raises(ConfigError, match=r"needs 1 GPU .* has 0"):
        check_ray_resources({"CPU": 64.0}, 2, on_cuda=True)


# ---------------------------------------------------------------- 23: one size unit everywhere


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("512MiB", 512 << 20), ("8GiB", 8 << 30), ("1.5GB", 1_500_000_000), ("2 kib", 2048)],
)
def test_sizes_parse_the_same_in_the_api_and_every_command(text: str, expected: int, tmp_path: Path) -> None:
    from pagedkv.cli import demo, generate
    from pagedkv.cli.engine_args import add_engine_arguments, engine_args_from
    from pagedkv.engine.args import EngineArgs

    assert EngineArgs(kv_cache_memory=text).kv_cache_memory == expected
    assert EngineArgs(host_kv_cache_memory=text, kv_cache_memory=8 << 30).host_kv_cache_memory == expected
    for module, extra in ((generate, ["--prompt", "x"]), (demo, [])):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        args = p.parse_args([*extra, "--kv-cache-memory", text, "--host-kv-cache-memory", text])
        assert args.kv_cache_memory == expected, module.__name__
        assert generate.offload_engine_args(args)["host_kv_cache_memory"] == expected, module.__name__
    p = argparse.ArgumentParser()
    add_engine_arguments(p)  # serve's engine flags
    sizes = ["--kv-cache-memory", text, "--host-kv-cache-memory", text, "--kv-cache-dir-max-bytes", text]
    engine_args = engine_args_from(p.parse_args([*sizes, "--kv-cache-dir", str(tmp_path)]), None)
    assert engine_args.kv_cache_memory == expected
    assert engine_args.host_kv_cache_memory == engine_args.kv_cache_dir_max_bytes == expected


def test_demo_default_pool_is_256_mib_in_bytes() -> None:
    from pagedkv.cli import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert p.parse_args([]).kv_cache_memory == 256 << 20


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "0", "12 parsecs"])
def test_a_bad_size_is_a_usage_error_or_a_config_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.cli import main
    from pagedkv.engine.args import EngineArgs

    with pytest.raises(ConfigError, match="kv_cache_memory"):
        EngineArgs(kv_cache_memory=bad)
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--kv-cache-memory", bad])
    assert exc.value.code == 2
    assert "argument --kv-cache-memory" in capsys.readouterr().err


# ---------------------------------------------------------------- 24: `serve --help`


def test_serve_help_says_each_flag_once_in_plain_text() -> None:
    from pagedkv.cli import serve

    p = argparse.ArgumentParser(prog="pagedkv serve")
    serve.add_arguments(p)
    text = p.format_help()
    for markup in (":class:", ":meth:", ":func:", "``", "~pagedkv"):
        assert markup not in text, markup
    helps = [a.help for a in p._actions if a.help and a.help != argparse.SUPPRESS]
    for h in helps:
        assert len(re.findall(r"default", h, re.I)) <= 1, h
    long_helps = [h for h in helps if len(h) > 60]
    assert len(long_helps) == len(set(long_helps)), "a paragraph is printed under two flags"
    assert text.count("KV pool size") == 1


# ---------------------------------------------------------------- 24: a core-only install

_NO_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` now fails as on an install without the engine extra
import pagedkv
from pagedkv.cli import main
try:
    pagedkv.LLM()
except pagedkv.MissingDependencyError as exc:
    assert isinstance(exc, ImportError)
    print("API:", exc)
sys.exit(main(["generate", "--prompt", "hi"]))
"""


def test_without_torch_the_engine_says_which_extra_to_install() -> None:
    proc = subprocess.run([PYTHON, "-c", _NO_TORCH], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "API: pagedkv.LLM needs torch, which is not installed: pip install 'pagedkv[engine]'" in proc.stdout
    assert "pagedkv generate: pagedkv generate needs torch" in proc.stderr
    assert "pip install 'pagedkv[engine]'" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- 22: the benches' record is opt-in


def test_every_bench_writes_its_record_only_with_write() -> None:
    from _results import add_write_flag  # benches/ is on pytest's path (pyproject.toml)

    p = argparse.ArgumentParser()
    add_write_flag(p)
    assert (
        p.parse_args([]).no_write and not p.parse_args(["--write"]).no_write and p.parse_args(["--no-write"]).no_write
    )
    for script in sorted((REPO / "benches").glob("*.py")):
        if script.name in ("_results.py", "record_cargo_bench.py"):  # the helper; `make bench-rust`'s recorder
            continue
        tree = ast.parse(script.read_text())
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        if "write_section" in calls:
            assert "add_write_flag" in calls, f"{script.name} writes RESULTS.md without the shared --write flag"
        assert '"--no-write"' not in script.read_text(), script.name


def test_a_bench_run_without_write_leaves_results_alone() -> None:
    results = REPO / "benches" / "RESULTS.md"
    before = results.read_bytes()
    proc = subprocess.run(
        [PYTHON, str(REPO / "benches" / "bench_bindings.py"), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "|" in proc.stdout  # it printed its table
    assert results.read_bytes() == before


# ---------------------------------------------------------------- 18: `make` installs quietly


def test_the_build_step_runs_pip_quietly_on_the_extras_markers() -> None:
    """`maturin develop` hands pip the package's Requires-Dist, extras included
    (`torch; extra == "engine"`); pip printed an "Ignoring ...: markers ... don't match" line for
    each. Run pip as the Makefile's build recipe does (its environment assignments, from
    `make -n`) on such lines: nothing may be printed."""
    import tomllib

    recipe = subprocess.run(
        ["make", "-n", "-B", ".venv/.build-stamp"], cwd=REPO, capture_output=True, text=True, timeout=60
    ).stdout
    line = next(x for x in recipe.splitlines() if "maturin develop" in x)
    env = dict(os.environ)
    for word in line.split("maturin", 1)[0].split():
        name, _, value = word.partition("=")
        if name.isupper() and "$" not in value:
            env[name] = value
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    requires = [f'{d.split(";")[0]}; extra == "{extra}"' for extra, deps in extras.items() for d in deps]
    proc = subprocess.run(
        [PYTHON, "-m", "pip", "install", "--no-input", "--no-deps", "numpy", *requires],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Ignoring" not in proc.stdout + proc.stderr
