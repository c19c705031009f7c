"""A disaggregated deployment on this machine: one prefill engine, one decode engine and the
router in front of them, three processes (``pagedkv serve --disagg``; tests and benchmarks).

    with start_disagg(engine_flags=["--num-blocks", "256"]) as deployment:
        client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="none")

The engines are ``pagedkv serve`` subprocesses on free loopback ports, each given the same
engine flags plus its ``--kv-transfer-config`` (prefill: ``"role": "producer"``, decode:
``"consumer"``). They start together: over gloo they form a two-rank group at start (decode
rank 0, which hosts the group's store; prefill rank 1), so neither is healthy before the other
is up. The router (``pagedkv router --prefill URL --decode URL``) starts once both are
healthy, on the given host and port. Each process runs in its own process group
(:class:`~pagedkv.server.launch.ServerProcess`): :meth:`DisaggDeployment.stop` ends the three
and nothing else.
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.distributed.transfer_config import SECRET_ENV
from pagedkv.errors import ConfigError
from pagedkv.server.launch import ServerProcess, free_port

__all__ = ["KV_TRANSPORTS", "DisaggDeployment", "RouterProcess", "kv_transfer_configs", "start_disagg"]

KV_TRANSPORTS = ("auto", "nixl", "gloo")


class RouterProcess(ServerProcess):
    """``python -m pagedkv router ARGS --host HOST --port PORT`` until :meth:`stop`: a
    :class:`ServerProcess` (own process group, log file, SIGTERM then SIGKILL) for the router.
    Healthy when its ``/health`` is, i.e. when every engine behind it is."""

    def __init__(self, args: Sequence[str] = (), *, host: str = "127.0.0.1", **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        self.bind_host = host
        # Where to reach it from here: a wildcard address is reached on loopback.
        reach = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        self.host = reach
        self.url = f"http://[{reach}]:{self.port}" if ":" in reach else f"http://{reach}:{self.port}"

    # The router's /health asks every engine behind it: give a probe more time.
    command = "router"
    health_probe_timeout = 10.0

    def _bind_host(self) -> str:
        return self.bind_host


class DisaggDeployment:
    """The three processes of :func:`start_disagg`; a context manager that stops them."""

    def __init__(self, prefill: ServerProcess, decode: ServerProcess, router: RouterProcess) -> None:
        self.prefill = prefill
        self.decode = decode
        self.router = router

    @property
    def url(self) -> str:
        """The router's base URL: where clients go."""
        return self.router.url

    @property
    def prefill_url(self) -> str:
        return self.prefill.url

    @property
    def decode_url(self) -> str:
        return self.decode.url

    @property
    def processes(self) -> dict[str, ServerProcess]:
        return {"router": self.router, "prefill": self.prefill, "decode": self.decode}

    def exited(self) -> str | None:
        """The name of a process that has exited ("router", "prefill", "decode"), else None."""
        for name, proc in self.processes.items():
            if proc.process is not None and proc.process.poll() is not None:
                return name
        return None

    def stop(self) -> None:
        """The router first (no new requests), then both engines at once (over gloo each may
        wait on the other while it shuts down)."""
        self.router.stop()
        _stop_together([self.prefill, self.decode])

    def __enter__(self) -> DisaggDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kv_transfer_configs(
    kv_transport: str = "auto", base: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(prefill, decode)`` ``kv_transfer_config`` dicts for a pair on this machine.

    ``base`` holds other keys for both (``lease_seconds``, ``kv_load_failure_policy``, ...);
    ``role``, ``transport`` and the ``gloo_*`` keys are the pair's own and override it. gloo
    (also possible under ``auto``: NIXL when installed, else gloo) gets a free port for the
    group's store, hosted by rank 0, the decode engine."""
    if kv_transport not in KV_TRANSPORTS:
        raise ConfigError(f"kv_transport must be one of {KV_TRANSPORTS}, got {kv_transport!r}")
    common = {"control_host": "127.0.0.1", "control_port": 0, **(base or {}), "transport": kv_transport}
    prefill = {**common, "role": "producer"}
    decode = {**common, "role": "consumer"}
    if kv_transport in ("gloo", "auto"):
        group = {"gloo_world_size": 2, "gloo_init_method": f"tcp://127.0.0.1:{free_port()}"}
        decode.update(group, gloo_rank=0)
        prefill.update(group, gloo_rank=1)
    else:
        for config in (prefill, decode):
            for key in ("gloo_rank", "gloo_world_size", "gloo_init_method"):
                config.pop(key, None)
    return prefill, decode


def start_disagg(
    model: str | None = None,
    engine_flags: Sequence[str] = (),
    kv_transport: str = "auto",
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    router_flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
    start_timeout: float = 300.0,
    keep_logs: bool = False,
) -> DisaggDeployment:
    """Start a prefill engine, a decode engine and the router; return when the router is
    healthy. ``engine_flags`` go to both engines (``pagedkv serve`` flags: engine arguments,
    ``--served-model-name``, ...); ``kv_transfer_config`` holds extra keys for both engines'
    configs (see :func:`kv_transfer_configs`); ``router_flags`` go to ``pagedkv router``.
    ``port`` None: a free one. On any failure (or Ctrl-C) what was started is stopped."""
    prefill_config, decode_config = kv_transfer_configs(kv_transport, kv_transfer_config)
    model_args = [model] if model else []
    # The engines authenticate each other's KV-transfer messages with a secret of this
    # deployment's own, passed in their environment (a command line is visible in `ps`).
    engine_env = {**(env or {}), SECRET_ENV: secrets.token_urlsafe(32)}

    def engine(config: dict[str, Any]) -> ServerProcess:
        args = [*model_args, *engine_flags, "--kv-transfer-config", json.dumps(config)]
        return ServerProcess(args, env=engine_env, start_timeout=start_timeout, keep_log=keep_logs)

    prefill, decode = engine(prefill_config), engine(decode_config)
    router_args = ["--prefill", prefill.url, "--decode", decode.url, *router_flags]
    if model:
        router_args += ["--model", model]
    router = RouterProcess(router_args, host=host, port=port, env=env, start_timeout=start_timeout, keep_log=keep_logs)
    _start_together([decode, prefill])
    try:
        router.start()
    except BaseException:  # its failure, or Ctrl-C while it starts: stop all three
        router.stop()
        _stop_together([prefill, decode])
        raise
    return DisaggDeployment(prefill, decode, router)


def _start_together(procs: Sequence[ServerProcess]) -> None:
    """Start ``procs`` at once (each :meth:`ServerProcess.start` in a thread) and wait until
    all are healthy. The first failure stops them all without waiting for the others (over
    gloo a lone engine would wait for its peer until its own timeout)."""
    errors: list[BaseException] = []

    def start(proc: ServerProcess) -> None:
        try:
            proc.start()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(p,), daemon=True, name="pagedkv-start") for p in procs]
    try:
        for t in threads:
            t.start()
        while not errors and any(t.is_alive() for t in threads):
            time.sleep(0.1)
    except BaseException:  # Ctrl-C / SIGTERM while starting
        _stop_started(procs, threads)
        raise
    if errors:
        _stop_started(procs, threads)
        raise errors[0]


def _stop_started(procs: Sequence[ServerProcess], threads: Sequence[threading.Thread]) -> None:
    """Stop processes whose start may still be running in ``threads``."""
    # A thread that has not yet spawned its process would spawn it after a stop: wait for the
    # spawn (immediate in start) before stopping.
    deadline = time.monotonic() + 10.0
    for proc, thread in zip(procs, threads):
        while proc.process is None and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    _stop_together(procs)
    for thread in threads:
        thread.join(5.0)  # its start sees the process gone and ends


def _stop_together(procs: Sequence[ServerProcess]) -> None:
    """SIGTERM them all first, then :meth:`ServerProcess.stop` each (SIGKILL when it hangs)."""
    for proc in procs:
        proc.signal(signal.SIGTERM)
    for proc in procs:
        proc.stop()
