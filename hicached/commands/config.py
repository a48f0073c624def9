"""``hicached config show``: print the resolved configuration (or every key)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicached.commands._common import add_config_flags, config_from_args
from hicached.config import ConfigError, as_dict, describe, to_toml, unknown_env


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "config", help="inspect the configuration", description="Inspect the daemon's configuration."
    )
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = sub.add_parser(
        "show",
        help="print the resolved configuration (flags > env > file > defaults)",
        description="Print the resolved configuration as TOML that `--config` reads back unchanged "
        "(flags > HICACHED_* environment > file > defaults). Unknown HICACHED_* variables are warned about.",
    )
    add_config_flags(show)
    show.add_argument(
        "--format", choices=("toml", "json"), default="toml", help="output format (default: toml)"
    )
    show.add_argument(
        "--keys", action="store_true", help="list every key with its default, env variable and meaning"
    )
    show.set_defaults(func=run_show)


def run_show(args: argparse.Namespace) -> int:
    if args.keys:
        for key, default, env, help_text in describe():
            print(f"{key:40} {default:28} {env:42} {help_text}")
        return 0
    for warning in unknown_env():
        print(f"hicached: warning: {warning}", file=sys.stderr)
    try:
        config = config_from_args(args, pipe=True)  # read once: a pipe given is the admin's choice
    except ConfigError as exc:
        print(f"hicached: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(as_dict(config), indent=2))
        return 0
    print(to_toml(config), end="")
    return 0
