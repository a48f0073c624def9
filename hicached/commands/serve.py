"""``hicached serve``: run the daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from hicached.commands._common import add_config_flags, config_from_args
from hicached.config import ConfigError, unknown_env

logger = logging.getLogger("hicached.serve")


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run the daemon",
        description="Run the hicached daemon (gRPC on a Unix socket by default) until SIGTERM/SIGINT. "
        "Configuration: flags > HICACHED_* environment > --config TOML > defaults; "
        "`hicached config show --keys` lists every key.",
    )
    add_config_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"hicached: configuration error: {exc}", file=sys.stderr)
        return 2
    from hicached.daemon import run_daemon
    from hicached.errors import FailedPrecondition
    from hicached.logs import setup_logging
    from hicached.server.sockets import StartupError as SocketError
    from hicached.startup import StartupError

    setup_logging(config.log.level, config.log.format)
    for warning in unknown_env():
        logger.warning(warning, extra={"event": "config"})
    try:
        return run_daemon(config, reload=lambda: config_from_args(args))
    except ConfigError as exc:  # a credential file (token, PEM) read at startup
        print(f"hicached: configuration error: {exc}", file=sys.stderr)
        return 2
    except (StartupError, SocketError) as exc:  # L3 cannot start; the socket is another daemon's
        print(f"hicached: {exc}", file=sys.stderr)
        return 2
    except FailedPrecondition as exc:  # a precondition of startup the sites above did not name
        print(f"hicached: cannot start: {exc}", file=sys.stderr)
        return 2
