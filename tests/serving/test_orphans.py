"""A server started by a process that dies without stopping it shuts itself down.

A test run killed with SIGKILL (or a crashed launcher) cannot run its cleanup, and every
server it started lives in a process group of its own: such servers used to keep their ports
and memory until someone killed them by hand (``pagedkv.orphan``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")

# The starter: a process that starts a server through ServerProcess, says its pid, and waits to
# be killed (it never stops the server itself).
_STARTER = """
import sys, time
from pagedkv.server.launch import ServerProcess
server = ServerProcess(["--num-blocks", "32", "--max-model-len", "256", "--dtype", "float32"]).start()
print(server.process.pid, flush=True)
time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_whose_starter_is_killed_shuts_itself_down() -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER], stdout=subprocess.PIPE, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    )
    server_pid = 0
    try:
        assert starter.stdout is not None
        line = starter.stdout.readline()
        assert line.strip(), "the starter did not start its server"
        server_pid = int(line)
        assert _alive(server_pid)
        starter.kill()  # SIGKILL: no cleanup runs in the starter
        starter.wait(30)
        deadline = time.monotonic() + 120
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid), "the orphaned server is still running"
    finally:
        if starter.poll() is None:
            starter.kill()
        if server_pid and _alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
