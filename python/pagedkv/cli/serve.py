"""`pagedkv serve`: the OpenAI-compatible HTTP server (needs ``pip install "pagedkv[serve]"``).

pagedkv serve                                   # the embedded SmolLM2 on 127.0.0.1:8000
pagedkv serve Qwen/Qwen2.5-0.5B-Instruct --port 8080 --api-key secret --max-num-seqs 64
pagedkv serve --kv-events-endpoint tcp://127.0.0.1:5557 --kv-events-replay-endpoint tcp://127.0.0.1:5558
pagedkv serve --disagg --kv-transport gloo --num-blocks 512   # prefill + decode engines, router on :8000

Every engine argument is a flag (``--block-size``, ``--num-blocks``, ``--swap-space``, ...:
``pagedkv serve --help``). SIGINT / SIGTERM shut it down gracefully.

``--disagg`` runs disaggregated prefill/decode on this machine (``pagedkv.router.launcher``):
a prefill engine and a decode engine (``pagedkv serve`` subprocesses on free loopback ports,
each with the engine flags given here and its ``--kv-transfer-config``; a
``--kv-transfer-config`` given here adds its keys, e.g. ``lease_seconds``, to both) and
``pagedkv router`` in front of them on ``--host``/``--port``. SIGINT / SIGTERM stop all three.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from pagedkv.cli.engine_args import add_engine_arguments, engine_args_from
from pagedkv.engine.args import EngineArgs
from pagedkv.errors import PagedKVError
from pagedkv.server.limits import add_limit_arguments, limit_flags, limits_from
from pagedkv.server.tools import TOOL_CALL_PARSERS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Hugging Face model id or folder, or gemma-3-270m (embedded)",
    )
    p.add_argument("--model", default=None, help="the same as MODEL (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients use in 'model' (default: the model's id)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDKV_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $PAGEDKV_API_KEY, else no auth)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="answer 503 when this many requests wait for their first token (default: no limit)",
    )
    p.add_argument("--kv-events-endpoint", default=None, help="publish KV-cache events on this ZMQ endpoint")
    p.add_argument("--kv-events-replay-endpoint", default=None, help="ZMQ endpoint of the events' replay socket")
    p.add_argument("--kv-events-topic", default="", help="topic frame of the published events (default: empty)")
    p.add_argument(
        "--dashboard-show-prompts",
        action="store_true",
        help="/dashboard shows the start of each request's prompt text (default: ids and token counts only)",
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests may take after a signal"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--disagg",
        action="store_true",
        help="disaggregated prefill/decode: a prefill engine, a decode engine and the router on --host/--port",
    )
    p.add_argument(
        "--kv-transport",
        choices=["auto", "nixl", "gloo"],
        default="auto",
        help="with --disagg: how the decode engine pulls KV (auto: NIXL when installed, else gloo)",
    )
    p.add_argument(
        "--allow-client-kv-transfer-params",
        action="store_true",
        help="with --disagg: the router passes a client's kv_transfer_params on (default: refused with 400)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=list(TOOL_CALL_PARSERS),
        default="hermes",
        help="how /v1/chat/completions finds tool calls in the output (vLLM's flag; default: hermes, "
        '<tool_call>{"name": ..., "arguments": ...}</tool_call> blocks)',
    )
    add_limit_arguments(p)
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    try:
        from pagedkv.server.app import ServerArgs
        from pagedkv.server.run import run_server
    except ImportError as exc:
        print(f"pagedkv serve needs the serve extra: pip install 'pagedkv[serve]' ({exc})", file=sys.stderr)
        return 2
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        print(f"error: MODEL {args.model_tag!r} and --model {args.model!r} differ", file=sys.stderr)
        return 2
    if args.disagg:
        return _run_disagg(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from(args, args.model_tag or args.model)
        server_args = ServerArgs(
            served_model_names=args.served_model_name or [],
            api_key=args.api_key,
            max_queued_requests=args.max_queued_requests,
            kv_events_endpoint=args.kv_events_endpoint,
            kv_events_replay_endpoint=args.kv_events_replay_endpoint,
            kv_events_topic=args.kv_events_topic,
            dashboard_show_prompts=args.dashboard_show_prompts,
            limits=limits_from(args),
            tool_call_parser=args.tool_call_parser,
        )
        run_server(
            engine_args,
            server_args,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            shutdown_timeout=args.shutdown_timeout,
        )
    except PagedKVError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


# EngineArgs fields --disagg does not pass on as given: the model is positional, and each
# engine gets its own kv_transfer_config (the user's keys merged in).
_NOT_PASSED_ON = frozenset({"model", "kv_transfer_config"})


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of the command line (those not at their default), for each engine."""
    flags = []
    for f in dataclasses.fields(EngineArgs):
        if f.name in _NOT_PASSED_ON:
            continue
        value = getattr(args, f.name)
        if value == f.default or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def _serve_flags(args: argparse.Namespace) -> list[str]:
    """The server flags each engine takes as this command got them."""
    flags = ["--log-level", args.log_level, "--shutdown-timeout", str(args.shutdown_timeout)]
    if args.served_model_name:
        flags += ["--served-model-name", *args.served_model_name]
    if args.max_queued_requests is not None:
        flags += ["--max-queued-requests", str(args.max_queued_requests)]
    return flags + limit_flags(args)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run_disagg(args: argparse.Namespace) -> int:
    """``pagedkv serve --disagg``: start the three processes, then wait for a signal (or for
    one of them to exit) and stop all three."""
    try:
        from pagedkv.router.launcher import start_disagg
    except ImportError as exc:
        print(f"pagedkv serve --disagg needs the serve extra: pip install 'pagedkv[serve]' ({exc})", file=sys.stderr)
        return 2
    # Both engines cannot publish on one endpoint.
    if args.kv_events_endpoint or args.kv_events_replay_endpoint:
        print("error: --kv-events-endpoint is not supported with --disagg", file=sys.stderr)
        return 2
    model = args.model_tag or args.model
    kv_config: dict[str, Any] | None = None
    try:
        engine_args_from(args, model)  # the same checks as each engine's, before starting any
        user_config = getattr(args, "kv_transfer_config", None)
        if user_config is not None:
            kv_config = json.loads(user_config)
            if not isinstance(kv_config, dict):
                raise ValueError("not a JSON object")
    except PagedKVError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: --kv-transfer-config: {exc}", file=sys.stderr)
        return 1
    # SIGTERM as Ctrl-C: both end in the `finally` that stops what was started.
    previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    previous_int = signal.getsignal(signal.SIGINT)
    deployment = None
    try:
        deployment = start_disagg(
            model,
            [*_engine_flags(args), *_serve_flags(args)],
            args.kv_transport,
            args.host,
            args.port,
            kv_transfer_config=kv_config,
            router_flags=[
                "--log-level",
                args.log_level,
                *(["--trust-remote-code"] if args.trust_remote_code else []),
                *(["--allow-client-kv-transfer-params"] if args.allow_client_kv_transfer_params else []),
            ],
            keep_logs=True,
            api_key=args.api_key,  # the router's clients' key; the engines get one of their own
        )
        print(
            f"pagedkv serve --disagg: {deployment.url} (prefill engine {deployment.prefill_url}, "
            f"decode engine {deployment.decode_url}); logs: "
            + ", ".join(f"{name} {proc.log_path}" for name, proc in deployment.processes.items()),
            flush=True,
        )
        while (name := deployment.exited()) is None:
            time.sleep(0.5)
        tail = deployment.processes[name].log_tail()
        print(f"error: the {name} process exited; stopping the others. Its log ends:\n{tail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except (PagedKVError, RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C must not cut the stop short and leave engines running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if deployment is not None:
            deployment.stop()
        # (None: a handler not set from Python, which cannot be put back.)
        signal.signal(signal.SIGINT, previous_int if previous_int is not None else signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous_term if previous_term is not None else signal.SIG_DFL)
