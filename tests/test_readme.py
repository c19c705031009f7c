"""Every code block of README.md runs as written.

The blocks are read from the README itself (its ``` fences), in order, and ``BLOCKS`` says how
each one is run: a README block the table does not classify, or a block that no longer starts
as its row says (a block was added, removed or moved), fails ``test_every_block_is_classified``
and its own test, so a new block cannot go untested. How a block is run:

* ``SCRIPT``: a ```python block, saved as a script and run with this interpreter (the project's
  virtualenv) in an empty temporary folder, as a newcomer runs it: ``python snippet.py``.
  ``SCRIPT_ALONE``: the same, while no other block runs (tensor parallelism: its three worker
  processes wait on each other, with timeouts, so they get the cores to themselves).
* Shell blocks (plain ```): each command (a line, with its ``\\`` continuations) has a way of
  its own, in order: ``RUN`` runs it with bash as written, the virtualenv's ``bin`` first on
  ``PATH`` (``pagedkv ...`` with small sizes; ``curl`` against the server below, its answer
  checked); ``PARSE`` gives the line to pagedkv's real command-line parser (the same code path
  as the command, with the subcommand's ``run`` replaced: the flags must exist and parse) for
  commands that serve until stopped (``pagedkv serve``, ``pagedkv router``) or take minutes
  (the full ``pagedkv demo``; a small one runs); ``SERVER`` is the
  command the module's server runs; ``DRY_RUN`` is ``make -n TARGET`` (the target exists and its
  recipe expands; ``make test`` takes ~20 minutes); ``HELP`` runs a benchmark script with
  ``--help`` (it imports and parses its flags; the benchmark itself takes minutes);
  ``MANIFEST`` checks that ``cargo bench`` has benchmark targets (compiling them takes minutes).

The blocks that talk to ``127.0.0.1:8000`` (curl and the ``openai`` client) get a real
``pagedkv serve`` on that port, started once for the module, in the background while the first
blocks run; they are skipped, with the reason, when the port is taken. The subprocesses that
need no server (scripts, ``pagedkv`` commands, the benchmarks' ``--help``) start when the module
does, two at a time (the machine this runs on may have two cores), and each test checks its own.
Every wait is bounded.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pagedkv.server.launch import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent
SERVER_PORT = 8000  # the port the README's examples address
TIMEOUT = 300.0  # one block on a busy 2-core machine; seconds on an idle one


class Way(enum.Enum):
    """How one README block (Python) or one command of a shell block is run (module docs)."""

    SCRIPT = "run as a script"
    SCRIPT_ALONE = "run as a script while no other block runs"
    SCRIPT_WITH_SERVER = "run as a script, against the module's server on :8000"
    RUN = "run as written"
    PARSE = "flags parsed by the real CLI parser, nothing started"
    SERVER = "the module's server"
    DRY_RUN = "make -n"
    HELP = "--help"
    MANIFEST = "cargo bench targets exist"


SCRIPT, SCRIPT_ALONE, SCRIPT_WITH_SERVER = Way.SCRIPT, Way.SCRIPT_ALONE, Way.SCRIPT_WITH_SERVER
RUN, PARSE, SERVER, DRY_RUN, HELP, MANIFEST = Way.RUN, Way.PARSE, Way.SERVER, Way.DRY_RUN, Way.HELP, Way.MANIFEST

# README order: (how the block's first line starts, its way or one way per command). The first
# item checks that the row still names the same block.
BLOCKS: list[tuple[str, Way | tuple[Way, ...]]] = [
    ("make demo", (DRY_RUN, DRY_RUN)),  # Quickstart (the demo runs, small, in "Command line")
    ("import pagedkv", SCRIPT),  # Python API: LLM.generate / chat
    ("import asyncio", SCRIPT),  # AsyncLLM streaming
    ("import pagedkv", SCRIPT),  # beam search
    ("import pagedkv", SCRIPT),  # KV offload tiers, LLM.get_stats
    ("import pagedkv", SCRIPT_ALONE),  # tensor parallelism: 3 worker processes, no __main__ guard
    ("import pagedkv", SCRIPT),  # the core alone
    ("pagedkv serve", (SERVER, PARSE)),  # Serving: the first line is the module's server
    ("curl", (RUN, RUN)),  # completions, streamed chat
    ("from openai import OpenAI", SCRIPT_WITH_SERVER),  # the openai client
    ("pagedkv serve --port 8001", (PARSE, PARSE, PARSE)),  # two replicas and a router
    ("pagedkv serve --disagg", (PARSE, PARSE)),  # disaggregated prefill / decode
    ("pagedkv generate", (RUN, RUN, RUN, PARSE, PARSE, PARSE, PARSE)),  # Command line
    ("cargo bench", (MANIFEST, DRY_RUN) + (HELP,) * 13),  # Benchmarks
]


@dataclass(frozen=True)
class Block:
    index: int
    lang: str
    text: str
    line: int  # of the opening fence, 1-based

    @property
    def first_line(self) -> str:
        return next((x.strip() for x in self.text.splitlines() if x.strip()), "")


def readme_blocks() -> list[Block]:
    return parse_blocks(README.read_text())


def parse_blocks(markdown: str) -> list[Block]:
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"README.md:{i + 1}: a code fence that is never closed"
        blocks.append(Block(len(blocks), m.group(1), "\n".join(lines[i + 1 : end]) + "\n", i + 1))
        i = end + 1
    return blocks


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """The block's commands: (the line as written, continuations joined; its argv), comment-only
    lines left out."""
    out: list[tuple[str, list[str]]] = []
    pending = ""
    for raw in block.text.splitlines():
        pending += raw
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1] + " "
            continue
        argv = shlex.split(pending, comments=True)
        if argv:
            out.append((pending.strip(), argv))
        pending = ""
    return out


def subprocess_env() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONUNBUFFERED": "1",
    }


@dataclass(frozen=True)
class Outcome:
    what: str
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    pgid: int  # the process group it ran in (its own)

    def check(self) -> str:
        """The output, once the command is known to have exited 0."""
        assert self.returncode == 0, (
            f"{self.what} {'ran past ' + str(TIMEOUT) + ' s' if self.returncode is None else f'exited with {self.returncode}'}"
            f"\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-5000:]}"
        )
        return self.stdout


def run(what: str, cmd: list[str], cwd: Path, timeout: float = TIMEOUT) -> Outcome:
    """Runs ``cmd`` in its own process group; past ``timeout`` the whole group is killed."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        return Outcome(what, None, out, err, proc.pid)
    return Outcome(what, proc.returncode, out, err, proc.pid)


class Jobs:
    """The blocks' subprocesses that need no server, started at the module's start, two at a
    time, in README order; a test takes its own outcome (or runs it then, when not started).
    A job started ``alone`` waits for both slots, so nothing else runs beside it."""

    # Two, or this process's share of the cores under pytest-xdist (conftest.py sets
    # OMP_NUM_THREADS to it): the subprocesses inherit that thread count.
    SLOTS = max(1, min(2, int(os.environ.get("OMP_NUM_THREADS") or 2)))

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=self.SLOTS, thread_name_prefix="readme-block")
        self._started: dict[str, Future[Outcome]] = {}
        self._free = self.SLOTS
        self._slot_freed = threading.Condition()

    def start(self, what: str, cmd: list[str], cwd: Path, *, alone: bool = False) -> None:
        self._started[what] = self._pool.submit(self._run, self.SLOTS if alone else 1, what, cmd, cwd)

    def _run(self, slots: int, what: str, cmd: list[str], cwd: Path) -> Outcome:
        with self._slot_freed:
            self._slot_freed.wait_for(lambda: self._free >= slots)
            self._free -= slots
        try:
            return run(what, cmd, cwd)
        finally:
            with self._slot_freed:
                self._free += slots
                self._slot_freed.notify_all()

    def outcome(self, what: str, cmd: list[str], cwd: Path) -> Outcome:
        started = self._started.pop(what, None)
        return started.result() if started is not None else run(what, cmd, cwd)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


# The module's server -------------------------------------------------------------------------


class ReadmeServer:
    """``pagedkv serve`` on 127.0.0.1:8000, started in a thread with the module (it loads while
    the first blocks run) and waited for by the blocks that need it."""

    def __init__(self) -> None:
        self.process: ServerProcess | None = None
        self.skip_reason: str | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, args: list[str]) -> None:
        if not port_is_free(SERVER_PORT):
            self.skip_reason = f"port {SERVER_PORT} is taken here: the README's server examples address it"
            return
        self.process = ServerProcess(args, port=SERVER_PORT, start_timeout=TIMEOUT)
        self._thread = threading.Thread(target=self._start, name="readme-server-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        assert self.process is not None
        try:
            self.process.start()
        except BaseException as e:  # reported to the tests that need the server
            self.error = e

    def ready(self) -> ServerProcess:
        if self.skip_reason is not None:
            pytest.skip(self.skip_reason)
        assert self._thread is not None and self.process is not None, "the module did not start the server"
        self._thread.join(TIMEOUT + 30)
        if self.error is not None:
            pytest.fail(f"the README's `pagedkv serve` did not start: {self.error}")
        assert not self._thread.is_alive(), "the server start is still waiting"
        return self.process

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(TIMEOUT + 30)
        if self.process is not None:
            self.process.stop()


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def needs_server(way: Way | tuple[Way, ...]) -> bool:
    return way is SCRIPT_WITH_SERVER or (isinstance(way, tuple) and SERVER in way)


def server_args(blocks: list[Block]) -> list[str]:
    """The flags of the serving block's first command, which the module's server runs: it must be
    a plain ``pagedkv serve`` (the embedded model on 127.0.0.1:8000)."""
    (index,) = [i for i, (_, way) in enumerate(BLOCKS) if isinstance(way, tuple) and SERVER in way]
    assert index < len(blocks), "the README has fewer blocks than BLOCKS"
    _, argv = commands(blocks[index])[0]
    assert argv[:2] == ["pagedkv", "serve"], argv
    assert not {"--host", "--port", "--api-key"} & set(argv), "the README's first server must be the plain one"
    return argv[2:]


@dataclass
class Module:
    """What the module's tests share: the README's blocks, the server, the started jobs."""

    blocks: list[Block]
    server: ReadmeServer
    jobs: Jobs
    tmp: pytest.TempPathFactory


def script_job(block: Block, tmp: pytest.TempPathFactory) -> tuple[str, list[str], Path]:
    """(name, command, folder) of a Python block run as a script in a fresh folder."""
    folder = tmp.mktemp(f"readme-block-{block.index}")
    (folder / "snippet.py").write_text(block.text)
    return f"README block {block.index} (line {block.line})", [sys.executable, "snippet.py"], folder


def command_job(block: Block, line: str, tmp: pytest.TempPathFactory) -> tuple[str, list[str], Path]:
    return line, ["bash", "-c", line], tmp.mktemp(f"readme-block-{block.index}")


def help_job(scripts: list[str]) -> tuple[str, list[str], Path]:
    """``python SCRIPT --help`` for every benchmark script, in one interpreter (the imports they
    share are paid once): each must exit 0 (argparse prints its usage)."""
    driver = (
        "import runpy, sys\n"
        "failed = []\n"
        "for path in sys.argv[1:]:\n"
        "    sys.argv = [path, '--help']\n"
        "    sys.path.insert(0, path.rsplit('/', 1)[0])\n"
        "    try:\n"
        "        runpy.run_path(path, run_name='__main__')\n"
        "        failed.append(f'{path}: returned without exiting on --help')\n"
        "    except SystemExit as e:\n"
        "        if e.code not in (0, None):\n"
        "            failed.append(f'{path}: exit {e.code}')\n"
        "    finally:\n"
        "        sys.path.pop(0)\n"
        "print('FAILED:', failed)\n"
        "sys.exit(1 if failed else 0)\n"
    )
    return "the benchmark scripts' --help", [sys.executable, "-c", driver, *scripts], ROOT


def shell_jobs(block: Block, ways: tuple[Way, ...], tmp: pytest.TempPathFactory) -> list[tuple[str, list[str], Path]]:
    """The block's commands that run as subprocesses without the server (``pagedkv`` commands and
    the benchmarks' ``--help``), in order."""
    jobs = []
    cmds = commands(block)
    for (line, argv), way in zip(cmds, ways):
        if way is RUN and argv[0] != "curl":
            jobs.append(command_job(block, line, tmp))
    scripts = [argv[1] for (_, argv), way in zip(cmds, ways) if way is HELP]
    if scripts:
        jobs.append(help_job(scripts))
    return jobs


@pytest.fixture(scope="module")
def module(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Module]:
    """Starts the server and the jobs of the blocks whose tests were selected (all, in a full run)."""
    blocks = readme_blocks()
    selected = sorted(
        {item.callspec.params["index"] for item in request.session.items if item.module is request.module and hasattr(item, "callspec")}
    )  # fmt: skip
    state = Module(blocks, ReadmeServer(), Jobs(), tmp_path_factory)
    matching = [i for i in selected if i < len(blocks) and blocks[i].first_line.startswith(BLOCKS[i][0])]
    if any(needs_server(BLOCKS[i][1]) for i in matching):
        state.server.start(server_args(blocks))
    for i in matching:
        way = BLOCKS[i][1]
        if way in (SCRIPT, SCRIPT_ALONE):
            state.jobs.start(*script_job(blocks[i], tmp_path_factory), alone=way is SCRIPT_ALONE)
        elif isinstance(way, tuple) and len(way) == len(commands(blocks[i])):
            for job in shell_jobs(blocks[i], way, tmp_path_factory):
                state.jobs.start(*job)
    yield state
    state.jobs.close()
    state.server.stop()


# How each way is checked ---------------------------------------------------------------------


def parse_only(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``pagedkv.cli.main(argv)`` with the subcommand's ``run`` replaced: argparse errors exit 2."""
    import importlib

    from pagedkv import cli

    assert argv[0] == "pagedkv", argv
    module = importlib.import_module(cli.SUBCOMMANDS[argv[1]][0])
    parsed: list[Any] = []
    monkeypatch.setattr(module, "run", lambda args: parsed.append(args) or 0)
    try:
        assert cli.main(argv[1:]) == 0
    except SystemExit as e:
        pytest.fail(f"`{shlex.join(argv)}` does not parse (exit {e.code})")
    assert len(parsed) == 1


def check_openai_answer(line: str, out: str) -> None:
    """A curl answer: a completion (JSON with choices) or, with -N, a stream ending in [DONE]."""
    assert '"error"' not in out, f"{line}\n-> {out[:2000]}"
    if " -N " in line:
        events = [x[len("data: ") :] for x in out.splitlines() if x.startswith("data: ")]
        assert events and events[-1] == "[DONE]", out[-2000:]
        assert all("choices" in json.loads(e) for e in events[:-1]), out[:2000]
    else:
        body = json.loads(out)
        assert body["choices"][0]["text"], body


def check_shell_block(block: Block, ways: tuple[Way, ...], m: Module, monkeypatch: pytest.MonkeyPatch) -> None:
    cmds = commands(block)
    assert len(cmds) == len(ways), (
        f"README block {block.index} (line {block.line}) has {len(cmds)} commands but BLOCKS gives {len(ways)} ways: "
        "classify each command"
    )
    for (line, argv), way in zip(cmds, ways):
        if way is SERVER:
            assert server_args(m.blocks) == argv[2:]
            m.server.ready()  # healthy on :8000, answering the blocks that follow
        elif way is PARSE:
            assert argv[:2] in (["pagedkv", "serve"], ["pagedkv", "router"], ["pagedkv", "demo"]), line
            parse_only(argv, monkeypatch)
        elif way is DRY_RUN:
            assert argv[0] == "make", line
            run(f"make -n {shlex.join(argv[1:])}", ["make", "-n", *argv[1:]], ROOT, timeout=60).check()
        elif way is HELP:
            assert argv[0] == "python" and argv[1].startswith("benches/") and len(argv) == 2, line
        elif way is MANIFEST:
            assert argv == ["cargo", "bench"], line
            cargo_metadata = ["cargo", "metadata", "--no-deps", "--format-version", "1"]
            meta = json.loads(run(line, cargo_metadata, ROOT, timeout=60).check())
            benches = [t for p in meta["packages"] for t in p["targets"] if "bench" in t["kind"]]
            assert benches and all(Path(t["src_path"]).is_file() for t in benches), benches
        elif way is RUN and argv[0] == "curl":
            m.server.ready()
            check_openai_answer(line, run(line, ["bash", "-c", line], ROOT).check())
        elif way is not RUN:
            pytest.fail(f"{way} is not a way to run a shell command")
    # The pagedkv commands, then the benchmarks' --help (started with the module).
    for what, cmd, cwd in shell_jobs(block, ways, m.tmp):
        out = m.jobs.outcome(what, cmd, cwd).check()
        assert out.strip(), f"{what} printed nothing"
        if cmd[0] == sys.executable:
            assert out.count("usage:") == len(cmd) - 3, out[-3000:]


def assert_group_ends(pgid: int, timeout: float) -> None:
    """Waits up to ``timeout`` s until no process of the group ``pgid`` is left (the group of a
    script that has exited: what it started and did not end, such as worker processes)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"a process of the script's group {pgid} is still running"
        time.sleep(0.2)


# The tests -----------------------------------------------------------------------------------


def test_every_block_is_classified() -> None:
    check_classified(readme_blocks())


def check_classified(blocks: list[Block]) -> None:
    rows = [f"{i}: {b.first_line[:60]!r} (line {b.line})" for i, b in enumerate(blocks)]
    assert len(blocks) == len(BLOCKS), (
        f"README.md has {len(blocks)} code blocks, BLOCKS classifies {len(BLOCKS)}: give every block a row\n"
        + "\n".join(rows)
    )
    for block, (start, way) in zip(blocks, BLOCKS):
        assert block.first_line.startswith(start), f"block {block.index} (line {block.line}) moved: {rows[block.index]}"
        assert (block.lang == "python") == (way in (SCRIPT, SCRIPT_ALONE, SCRIPT_WITH_SERVER)), f"block {block.index}"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_written(index: int, module: Module, monkeypatch: pytest.MonkeyPatch) -> None:
    assert index < len(module.blocks), f"BLOCKS has a row {index} for a block the README no longer has"
    block = module.blocks[index]
    start, way = BLOCKS[index]
    assert block.first_line.startswith(start), f"README block {index} (line {block.line}) is not {start!r}"
    if way in (SCRIPT, SCRIPT_ALONE):
        outcome = module.jobs.outcome(*script_job(block, module.tmp))
        assert outcome.check().strip(), f"README block {index} printed nothing"
        # Nothing the script started outlives it (the tensor-parallel block's worker processes).
        assert_group_ends(outcome.pgid, 30.0)
    elif way is SCRIPT_WITH_SERVER:
        module.server.ready()
        out = run(*script_job(block, module.tmp)).check()
        assert "cached prompt tokens:" in out, out
    else:
        assert isinstance(way, tuple), way
        check_shell_block(block, way, module, monkeypatch)


def test_the_checks_catch_a_broken_block(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the issue found fails here: a snippet using a name it never defines, top-level
    ``async for``, a flag the command line does not have, a README block nobody classified."""
    for i, text in enumerate(["import pagedkv\n\nprint(llm)\n", "async for x in y:\n    print(x)\n"]):
        with pytest.raises(AssertionError, match="NameError|SyntaxError"):
            run(*script_job(Block(100 + i, "python", text, 1), tmp_path_factory)).check()
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        parse_only(["pagedkv", "serve", "--no-such-flag", "1"], monkeypatch)
    extra = parse_blocks(README.read_text() + "\n```python\nprint('new')\n```\n")
    with pytest.raises(AssertionError, match="give every block a row"):
        check_classified(extra)
