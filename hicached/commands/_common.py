"""What the commands share: the flags of those that build a configuration (serve, config
show), :func:`shown`, how every command prints text a daemon sent, and the integer flags' types.

Thread-safety: pure functions (argument parsing happens once, on the main thread).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hicached.coerce import one_of
from hicached.config import ALIASES, Config, ConfigError, LogFormat, LogLevel, describe, resolve
from hicached.errors import clip
from hicached.l3.registry import L3Backend
from hicached.logs import escape_controls


def _int_flag(least: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:32]!r} is not an integer") from None
        if not least <= value < 1 << 31:  # the wire's fields are 32-bit
            raise argparse.ArgumentTypeError(f"{text[:32]!r} is not an integer in [{least}, 2**31)")
        return value

    return parse


# argparse types of integer flags: out of range is a usage error naming the flag (exit 2), not
# a traceback from the wire's conversion (``--tp-rank -1``) nor a bare "Value out of range".
positive = _int_flag(1)
count = _int_flag(0)


def shown(text: str) -> str:
    """``text`` that came from a daemon, as a command prints it: every non-printable
    character (C0 and C1 controls such as ESC, CR and newline, DEL, bidi overrides and other
    format characters) written as its Python escape (``\\x1b``), the rest unchanged.

    A daemon's strings are a stranger's: the worker that chose its instance id or pool name,
    an older daemon that let it, or any process answering on the socket. Printed raw, their
    escape sequences retitled the admin's window, cleared the screen and wrote the clipboard
    (OSC 52). Readable and one line, not reversible (a backslash stays as it is).
    """
    return escape_controls(text)


# flag dest -> dotted configuration key
CONFIG_FLAGS: dict[str, tuple[str, str]] = {
    "socket": ("server.socket", "Unix socket path"),
    "listen": ("server.listen", "also listen on TCP HOST:PORT"),
    "metrics_port": ("server.metrics_port", "serve Prometheus /metrics on this port (0 = any)"),
    "host_budget": ("host.budget", "node-wide host memory budget, e.g. 8GiB"),
    "l3": ("l3.backend", f"L3 backend: {one_of(L3Backend)}"),
    "l3_path": ("l3.file.path", "directory of the file backend"),
    "lease_ms": ("sessions.lease_ms", "default session lease in milliseconds"),
    "log_level": ("log.level", f"log level: {one_of(LogLevel)}"),
    "log_format": ("log.format", f"log format: {one_of(LogFormat)}"),
}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML configuration file (default: $HICACHED_CONFIG)")
    defaults = {key: default for key, default, _env, _help in describe()}
    for dest, (key, help_text) in CONFIG_FLAGS.items():
        parser.add_argument(
            "--" + dest.replace("_", "-"),
            dest=dest,
            metavar=key.split(".")[-1].upper(),
            help=f"{help_text} (key {key}; default: {defaults[key]})",
        )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="set any configuration key, e.g. l3.redis.host=10.0.0.5 (repeatable; "
        "see `hicached config show --keys`)",
    )


def config_from_args(args: argparse.Namespace, *, pipe: bool = False) -> Config:
    """The configuration of the command line; ``pipe``: ``--config`` may name a pipe
    (:func:`hicached.config.resolve`)."""
    cli: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for item in args.set:
        given, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects SECTION.KEY=VALUE, got {clip(item)}")
        given = given.strip()
        key = ALIASES.get(given, given)  # l3.path is l3.file.path
        if spelled.setdefault(key, given) != given:  # the same spelling again: the last wins
            raise ConfigError(
                f"{clip(key)} is given twice by --set (as {clip(spelled[key])} and {clip(given)})"
            )
        cli[key] = value
    for dest, (key, _) in CONFIG_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            if key in cli:
                raise ConfigError(f"{key} is given twice: by --{dest.replace('_', '-')} and by --set")
            cli[key] = value
    return resolve(cli=cli, file=args.config, pipe=pipe)
