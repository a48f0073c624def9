"""The ``hicached`` command line.

Each subcommand lives in its own module under ``hicached.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (the handler,
taking the parsed namespace and returning an exit code). Adding a command is
one module plus one entry in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from hicached import __version__

# Module names under hicached.commands, in --help order.
COMMANDS = ("serve", "status", "lookup", "bench", "keys", "config")
# Exit codes of a process ended by SIGPIPE / SIGINT in a shell (128 + signal number).
EXIT_BROKEN_PIPE = 141
EXIT_INTERRUPTED = 130
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicached", description="HiCache tiering daemon for LLM inference")
    parser.add_argument("--version", action="version", version=f"hicached {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"hicached.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # OpenMP threads that spin after each parallel torch op would take the cores the
    # copies (ours, or a co-located worker's) need; set before torch is first imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # gRPC's EventEngine listener and client cost more CPU per call than the poller they
    # replace, which grpcio still ships (docs/performance.md: the daemon's CPU per RPC about
    # 10-20 % lower without them, a CLI client's about 30 %). Read when gRPC starts, so set
    # here, before anything imports it; an operator's own GRPC_EXPERIMENTS wins.
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    # gRPC's C core logs to stderr at INFO unless told otherwise, outside our logging and its
    # log.max_rate, and some of its lines are a stranger's to cause at will: each failed TLS
    # handshake on the daemon's TCP port is one (2,000 plaintext connections wrote 2,000 lines,
    # 410 KB, in 1.5 s). Keep its errors only; GRPC_VERBOSITY=INFO (the operator's) shows them.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        result: int = func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`hicached keys ... | head`): stop quietly like other Unix
        # tools; stdout goes to /dev/null so the interpreter's final flush cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return result


if __name__ == "__main__":
    sys.exit(main())
