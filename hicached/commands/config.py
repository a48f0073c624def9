"""``hicached config show``: print the resolved configuration (or every key)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicached.commands._common import add_config_flags, config_from_args
from hicached.config import ConfigError, as_dict, describe


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser("config", help="inspect the configuration")
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print the resolved configuration (flags > env > file > defaults)")
    add_config_flags(show)
    show.add_argument("--format", choices=("toml", "json"), default="toml")
    show.add_argument("--keys", action="store_true", help="list every key with its default and env variable")
    show.set_defaults(func=run_show)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def run_show(args: argparse.Namespace) -> int:
    if args.keys:
        for key, default, env, help_text in describe():
            print(f"{key:40} {default:28} {env:42} {help_text}")
        return 0
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"hicached: configuration error: {exc}", file=sys.stderr)
        return 2
    data = as_dict(config)
    if args.format == "json":
        print(json.dumps(data, indent=2))
        return 0
    for section, values in data.items():
        print(f"[{section}]")
        for key, value in values.items():
            print(f"{key} = {_toml_value(value)}")
        print()
    return 0
