"""`pagedkv router`: one OpenAI-compatible front for several `pagedkv serve` replicas, routing
each request to the replica that holds the longest cached prefix of its prompt.

pagedkv serve --port 8001 --kv-events-endpoint tcp://127.0.0.1:5557 --kv-events-replay-endpoint tcp://127.0.0.1:5558
pagedkv serve --port 8002 --kv-events-endpoint tcp://127.0.0.1:5567 --kv-events-replay-endpoint tcp://127.0.0.1:5568
pagedkv router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --port 8000

The replicas must be up: the router asks each for its block size and event endpoints
(``/kv_cache_info``) when it starts.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedkv.errors import PagedKVError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", required=True, help="a replica's base URL (repeat for each)")
    p.add_argument("--model", default=None, help="the replicas' model, for its tokenizer (default: embedded SmolLM2)")
    p.add_argument("--policy", choices=["cache_aware", "round_robin"], default="cache_aware")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="sent to the replicas when a client sends no Authorization")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from pagedkv.router.app import RouterArgs, create_router_app
    except ImportError as exc:
        print(f"pagedkv router needs the serve extra: pip install 'pagedkv[serve]' ({exc})", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        app = create_router_app(
            RouterArgs(replicas=args.replica, model=args.model, policy=args.policy, api_key=args.api_key)
        )
    except PagedKVError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
