"""`pagedkv serve`: the OpenAI-compatible HTTP server (needs ``pip install "pagedkv[serve]"``).

pagedkv serve                                   # the embedded SmolLM2 on 127.0.0.1:8000
pagedkv serve Qwen/Qwen2.5-0.5B-Instruct --port 8080 --api-key secret --max-num-seqs 64
pagedkv serve --kv-events-endpoint tcp://127.0.0.1:5557 --kv-events-replay-endpoint tcp://127.0.0.1:5558

Every engine argument is a flag (``--block-size``, ``--num-blocks``, ``--swap-space``, ...:
``pagedkv serve --help``). SIGINT / SIGTERM shut it down gracefully.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedkv.cli.engine_args import add_engine_arguments, engine_args_from
from pagedkv.errors import PagedKVError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="Hugging Face model id or folder")
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
        "--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests may take after a signal"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
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
