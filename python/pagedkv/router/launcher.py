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

A prefill engine that dies does not end the deployment: the router routes around it (each
request is then prefilled by the decode engine) and a :class:`ProcessKeeper` starts it again on
the same port, with growing pauses between failed tries, when its transport lets a new engine
join (NIXL: the decode engine meets a new producer through its control address). Over gloo the
decode engine's two-rank group cannot take a new member, so the prefill engine is not
restarted: the deployment serves without disaggregation until it is restarted (logged). A dead
decode engine or router ends the deployment (:meth:`DisaggDeployment.exited`): without them
nothing can be answered, and over gloo a new decode engine would need a new prefill engine too.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.distributed.transfer_config import SECRET_ENV
from pagedkv.errors import ConfigError
from pagedkv.server.launch import ServerProcess, free_port

__all__ = [
    "KV_TRANSPORTS",
    "DisaggDeployment",
    "ProcessKeeper",
    "RouterProcess",
    "kv_transfer_configs",
    "start_disagg",
]

logger = logging.getLogger(__name__)

KV_TRANSPORTS = ("auto", "nixl", "gloo")


class RouterProcess(ServerProcess):
    """``python -m pagedkv router ARGS --host HOST --port PORT`` until :meth:`stop`: a
    :class:`ServerProcess` (own process group, log file, SIGTERM then SIGKILL) for the router.
    Healthy when its ``/health`` is, i.e. when an engine that answers requests is up."""

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


class ProcessKeeper:
    """Starts ``proc`` again (same arguments, port and environment) each time it exits, from a
    thread, until :meth:`stop`. Pauses ``first_pause`` seconds before the first try, doubling
    after each failed start up to ``max_pause``; back to ``first_pause`` once a restarted
    process has stayed up ``max_pause`` seconds. ``restart=False``: only logs the exit."""

    def __init__(
        self,
        proc: ServerProcess,
        name: str,
        *,
        restart: bool = True,
        why_not: str = "",
        first_pause: float = 1.0,
        max_pause: float = 60.0,
    ) -> None:
        self.proc = proc
        self.name = name
        self.restart = restart
        self.why_not = why_not
        self.first_pause = first_pause
        self.max_pause = max_pause
        self.restarts = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards `proc` against a swap during stop
        self._thread = threading.Thread(target=self._run, name=f"pagedkv-keep-{name}", daemon=True)

    def start(self) -> ProcessKeeper:
        self._thread.start()
        return self

    def _exited(self) -> int | None:
        process = self.proc.process
        return None if process is None else process.poll()

    def _run(self) -> None:
        pause = self.first_pause
        up_since = time.monotonic()
        while not self._stop.wait(0.2):
            code = self._exited()
            if code is None:
                if time.monotonic() - up_since >= self.max_pause:
                    pause = self.first_pause
                continue
            tail = self.proc.log_tail(2000)
            if not self.restart:
                logger.error(
                    "the %s process exited with %s; %s. Its log ends:\n%s", self.name, code, self.why_not, tail
                )
                return
            logger.warning(
                "the %s process exited with %s; starting it again in %g s. Its log ends:\n%s",
                self.name,
                code,
                pause,
                tail,
            )
            if self._stop.wait(pause):
                return
            old = self.proc
            with self._lock:
                if self._stop.is_set():
                    return
                self.proc = ServerProcess(
                    old.args, port=old.port, env=old.env, start_timeout=old.start_timeout, keep_log=old.keep_log
                )
            old.stop()  # its log file
            try:
                self.proc.start()
            except (RuntimeError, TimeoutError, OSError) as exc:
                if self._stop.is_set():
                    return
                logger.warning("starting the %s process again failed: %s", self.name, exc)
                pause = min(2 * pause, self.max_pause)
                continue
            self.restarts += 1
            up_since = time.monotonic()
            logger.warning("the %s process is back on %s (restart %d)", self.name, self.proc.url, self.restarts)

    def stop(self) -> None:
        """Stop watching (the process itself is left to the caller), and stop a process the
        keeper may be starting right now."""
        self._stop.set()
        self._thread.join(0.5)  # an idle keeper ends at once
        while self._thread.is_alive():  # it is starting a process: stop it; its start() raises
            with self._lock:
                starting = self.proc
            starting.stop()
            self._thread.join(0.2)


class DisaggDeployment:
    """The three processes of :func:`start_disagg`; a context manager that stops them. The
    prefill engine is watched by a :class:`ProcessKeeper` (restarted where it can rejoin)."""

    def __init__(
        self,
        prefill: ServerProcess,
        decode: ServerProcess,
        router: RouterProcess,
        *,
        restart_prefill: bool = False,
        engine_api_key: str | None = None,
    ) -> None:
        self.decode = decode
        # The key the engines require (the router's engine key): for talking to them directly.
        self.engine_api_key = engine_api_key
        self.router = router
        why_not = "" if restart_prefill else _NO_GLOO_RESTART
        self.prefill_keeper = ProcessKeeper(prefill, "prefill", restart=restart_prefill, why_not=why_not).start()

    @property
    def prefill(self) -> ServerProcess:
        """The prefill engine's current process (a new one after each restart)."""
        return self.prefill_keeper.proc

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

    def engine_headers(self) -> dict[str, str]:
        """The headers that authenticate a direct request to either engine."""
        return {"Authorization": f"Bearer {self.engine_api_key}"} if self.engine_api_key else {}

    @property
    def processes(self) -> dict[str, ServerProcess]:
        return {"router": self.router, "prefill": self.prefill, "decode": self.decode}

    def exited(self) -> str | None:
        """The name of a process whose exit ends the deployment ("router", "decode"), else None
        (the prefill engine's exit does not: see :class:`ProcessKeeper`)."""
        for name, proc in (("router", self.router), ("decode", self.decode)):
            if proc.process is not None and proc.process.poll() is not None:
                return name
        return None

    def stop(self) -> None:
        """The router first (no new requests), then both engines at once (over gloo each may
        wait on the other while it shuts down)."""
        self.router.stop()
        self.prefill_keeper.stop()
        _stop_together([self.prefill, self.decode])

    def __enter__(self) -> DisaggDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_NO_GLOO_RESTART = (
    "over gloo a new prefill engine cannot join the decode engine's group, so it is not restarted: "
    "the decode engine prefills every request until the deployment is restarted"
)


def _rejoinable(engine: ServerProcess) -> bool:
    """Whether a restarted ``engine`` can take part again: its transport is not gloo."""
    try:
        with urllib.request.urlopen(engine.url + "/kv_cache_info", timeout=10.0) as response:
            info = json.loads(response.read())
        return bool((info.get("kv_transfer") or {}).get("transport") not in (None, "gloo"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return False


def kv_transfer_configs(
    kv_transport: str = "auto", base: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(prefill, decode)`` ``kv_transfer_config`` dicts for a pair on this machine.

    ``base`` holds other keys for both (``lease_seconds``, ``kv_load_failure_policy``, ...);
    ``role``, ``transport`` and the ``gloo_*`` keys are the pair's own and override it. gloo
    (also possible under ``auto``: NIXL when installed, else gloo) gets a free port for the
    group's store, hosted by rank 0, the decode engine.

    The prefill engine's control socket gets a port of its own now (a free one unless ``base``
    names one), so that the decode engine can be told, in ``allowed_producers``, the one address
    it pulls from: params naming any other address are refused (a 400) before it connects
    anywhere. A restarted prefill engine binds the same port again."""
    if kv_transport not in KV_TRANSPORTS:
        raise ConfigError(f"kv_transport must be one of {KV_TRANSPORTS}, got {kv_transport!r}")
    common = {"control_host": "127.0.0.1", "control_port": 0, **(base or {}), "transport": kv_transport}
    if not common["control_port"]:
        common["control_port"] = free_port(str(common["control_host"]))
    prefill = {**common, "role": "producer"}
    producer = f"tcp://{common['control_host']}:{common['control_port']}"
    decode = {**common, "role": "consumer", "allowed_producers": [*common.get("allowed_producers", ()), producer]}
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
    api_key: str | None = None,
) -> DisaggDeployment:
    """Start a prefill engine, a decode engine and the router; return when the router is
    healthy. ``engine_flags`` go to both engines (``pagedkv serve`` flags: engine arguments,
    ``--served-model-name``, ...); ``kv_transfer_config`` holds extra keys for both engines'
    configs (see :func:`kv_transfer_configs`); ``router_flags`` go to ``pagedkv router``.
    ``port`` None: a free one. ``api_key``: the key the router's clients must send (None: the
    router is open to whoever reaches it). The engines always require a key of the
    deployment's own that only the router holds (``DisaggDeployment.engine_api_key``), so
    nobody goes around the router to them. On any failure (or Ctrl-C) what was started is
    stopped."""
    prefill_config, decode_config = kv_transfer_configs(kv_transport, kv_transfer_config)
    model_args = [model] if model else []
    # The engines authenticate each other's KV-transfer messages with a secret of this
    # deployment's own, passed in their environment (a command line is visible in `ps`).
    # Likewise the engines' HTTP key (PAGEDKV_API_KEY, read by `pagedkv serve`), which only the
    # router holds as its engine key; the router's own clients use ``api_key``.
    engine_api_key = secrets.token_urlsafe(32)
    engine_env = {**(env or {}), SECRET_ENV: secrets.token_urlsafe(32), "PAGEDKV_API_KEY": engine_api_key}
    router_env = {**(env or {}), "PAGEDKV_ENGINE_API_KEY": engine_api_key}
    router_env.pop("PAGEDKV_ROUTER_API_KEY", None)
    if api_key is not None:
        router_env["PAGEDKV_ROUTER_API_KEY"] = api_key

    def engine(config: dict[str, Any]) -> ServerProcess:
        args = [*model_args, *engine_flags, "--kv-transfer-config", json.dumps(config)]
        return ServerProcess(args, env=engine_env, start_timeout=start_timeout, keep_log=keep_logs)

    prefill, decode = engine(prefill_config), engine(decode_config)
    router_args = ["--prefill", prefill.url, "--decode", decode.url, *router_flags]
    if model:
        router_args += ["--model", model]
    router = RouterProcess(
        router_args, host=host, port=port, env=router_env, start_timeout=start_timeout, keep_log=keep_logs
    )
    _start_together([decode, prefill])
    try:
        router.start()
    except BaseException:  # its failure, or Ctrl-C while it starts: stop all three
        router.stop()
        _stop_together([prefill, decode])
        raise
    return DisaggDeployment(
        prefill, decode, router, restart_prefill=_rejoinable(prefill), engine_api_key=engine_api_key
    )


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
