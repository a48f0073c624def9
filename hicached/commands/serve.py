"""``hicached serve``: run the daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
from collections.abc import Callable
from typing import Any

from hicached.commands._common import add_config_flags, config_from_args
from hicached.config import Config, ConfigError, is_pipe, unknown_env

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


def raise_fd_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard one. Service managers and shells often start a
    process at a soft limit of 1,024 while allowing far more; the daemon's descriptors (handoff
    tickets, lanes, connections, L3 files) are bounded by its own limits (docs/limits.md), and
    at 1,024 the sum of those bounds would let clients run it out of descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # e.g. an unlimited hard limit above fs.nr_open
        logger.warning(
            "descriptor limit left at %d (hard %d): %s", soft, hard, exc, extra={"event": "rlimit"}
        )
        return
    logger.info("descriptor limit raised from %d to %d", soft, hard, extra={"event": "rlimit"})


def _reloader(args: argparse.Namespace) -> Callable[[], Config]:
    """What SIGHUP reads: the command line's configuration again, its file a regular file only
    (a FIFO swapped in later must not block the event loop). A ``--config`` that was a pipe
    has nothing left to read: each SIGHUP is refused with one line, the configuration kept."""
    if args.config is not None and is_pipe(args.config):
        where = str(args.config)

        def refuse() -> Config:
            raise ConfigError(
                f"the configuration came from the pipe {where} and cannot be re-read; keeping the "
                "current one (restart the daemon to change it)"
            )

        return refuse
    return lambda: config_from_args(args)


def elsewhere(config: Config) -> list[str]:
    """A warning when ``$HICACHED_SOCKET`` (where clients, ``status`` and ``lookup`` look)
    names another Unix socket than the one this daemon serves: the daemon does not read it,
    so a start that relied on it serves where none of them look."""
    from hicached_client._channel import SOCKET_ENV, socket_target

    given = os.environ.get(SOCKET_ENV, "")
    target = socket_target(given) if given else ""
    if not target.startswith("unix:"):  # unset, or a TCP target
        return []
    path = target.removeprefix("unix://") if target.startswith("unix://") else target.removeprefix("unix:")
    served = os.path.abspath(config.server.socket)
    if os.path.abspath(path) == served:
        return []
    return [
        f"{SOCKET_ENV}={given[:200]!r} is where clients look, but this daemon serves {served}: "
        "set server.socket (--socket or HICACHED_SERVER_SOCKET) to serve there"
    ]


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args, pipe=True)
    except ConfigError as exc:
        print(f"hicached: configuration error: {exc}", file=sys.stderr)
        return 2
    from hicached.daemon import run_daemon
    from hicached.errors import FailedPrecondition, StartupError
    from hicached.logs import setup_logging

    setup_logging(config.log.level, config.log.format, config.log.max_rate)
    for warning in [*unknown_env(), *elsewhere(config)]:
        logger.warning(warning, extra={"event": "config"})
    raise_fd_limit()
    try:
        return run_daemon(config, reload=_reloader(args))
    except ConfigError as exc:  # a credential file (token, PEM) read at startup
        print(f"hicached: configuration error: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:  # L3 cannot start; the socket is another daemon's
        print(f"hicached: {exc}", file=sys.stderr)
        return 2
    except FailedPrecondition as exc:  # a precondition of startup the sites above did not name
        print(f"hicached: cannot start: {exc}", file=sys.stderr)
        return 2
