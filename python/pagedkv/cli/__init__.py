"""The `pagedkv` command line (also `python -m pagedkv`).

Subcommands, each in its own module (imported only when used, so `simulate` never loads torch):

* ``generate``  generate text with a model (``pagedkv.cli.generate``)
* ``demo``      batched generation over ShareGPT prompts on the embedded model (``pagedkv.cli.demo``)
* ``simulate``  replay a workload through the scheduler without a model (``pagedkv.cli.simulate``)
* ``serve``     the OpenAI-compatible HTTP server (``pagedkv.cli.serve``; the ``serve`` extra)
* ``router``    a KV-aware front for several ``serve`` replicas (``pagedkv.cli.router``)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pagedkv.errors import MissingDependencyError
from pagedkv.extras import needs_extra
from pagedkv.orphan import watch_parent_from_env

# subcommand -> (module, one-line help). Each module defines add_arguments(parser) and run(args).
SUBCOMMANDS = {
    "generate": ("pagedkv.cli.generate", "generate text for one or more prompts"),
    "demo": ("pagedkv.cli.demo", "batched generation over ShareGPT prompts on the embedded SmolLM2"),
    "simulate": ("pagedkv.cli.simulate", "replay a workload through the scheduler, without a model"),
    "serve": ("pagedkv.cli.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "router": ("pagedkv.cli.router", "route requests to serve replicas by the prefixes they have cached"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description="Serve LLMs on a paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, add_help=False)
        p.set_defaults(_module=module_name)
        # Arguments are added lazily below, once the subcommand is known.
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Find the subcommand first, then let its module add its own arguments.
    known, _ = parser.parse_known_args(argv)
    # Started by another pagedkv process (ServerProcess): leave when it is gone.
    watch_parent_from_env(f"pagedkv {known.command}")
    try:
        # A core-only install lacks the engine's packages: say which extra to install.
        with needs_extra(f"pagedkv {known.command}"):
            module = importlib.import_module(known._module)
            sub_parser = argparse.ArgumentParser(
                prog=f"pagedkv {known.command}", description=SUBCOMMANDS[known.command][1]
            )
            module.add_arguments(sub_parser)
            args = sub_parser.parse_args(argv[argv.index(known.command) + 1 :])
            return int(module.run(args) or 0)
    except MissingDependencyError as exc:
        print(f"pagedkv {known.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
