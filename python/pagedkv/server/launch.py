"""Start ``pagedkv serve`` in a subprocess and wait until it is healthy (tests, benchmarks,
and anything that runs engines as separate processes).

    with ServerProcess(["--num-blocks", "256"]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

The process runs in its own process group, so stopping it (SIGTERM: a graceful shutdown, then
SIGKILL after ``stop_timeout``) ends it and nothing else. It also shuts itself down when the
process that started it is gone (``pagedkv.orphan``): a test run or launcher killed without
cleaning up leaves no server behind. Its output goes to a log file
(``log_tail()``; its tail is in the error when it fails to start), deleted by :meth:`stop`
unless ``keep_log``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from pagedkv.orphan import PARENT_PID_ENV

__all__ = ["ServerProcess", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python -m pagedkv serve ARGS --host 127.0.0.1 --port PORT`` until :meth:`stop`."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 300.0,
        stop_timeout: float = 30.0,
        keep_log: bool = False,
    ) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.url = f"http://{self.host}:{self.port}"
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.env[PARENT_PID_ENV] = str(os.getpid())
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.keep_log = keep_log
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="pagedkv-serve-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)

    # What runs (``python -m pagedkv <command> ARGS --host H --port P``) and how long one
    # ``/health`` probe may take; a subclass runs another command (the router).
    command = "serve"
    health_probe_timeout = 2.0

    def _bind_host(self) -> str:
        return self.host

    def start(self) -> ServerProcess:
        """Starts the process and waits until its ``/health`` answers 200 (RuntimeError if it
        exits first, TimeoutError after ``start_timeout``; either way it is stopped)."""
        cmd = [sys.executable, "-m", "pagedkv", self.command, *self.args]
        cmd += ["--host", self._bind_host(), "--port", str(self.port)]
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"pagedkv {self.command} exited with {self.process.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=self.health_probe_timeout) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or not healthy yet (503)
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(f"pagedkv {self.command} did not become healthy in {self.start_timeout} s:\n{tail}")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server's process group (it is the group's leader)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self) -> int | None:
        """SIGTERM (graceful), then SIGKILL if it has not exited after ``stop_timeout``."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.process.wait(10)
        self._log.close()
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode

    def log_tail(self, num_chars: int = 4000) -> str:
        if not self.log_path.exists():
            return "(log deleted)"
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
