"""The configuration written back out: TOML, nested dicts, the key table, env-var warnings.

Pure functions (thread-safe); :func:`to_toml` writes a document :func:`resolve` reads
back to the same configuration.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicached.coerce import format_mode
from hicached.config.resolver import ALIASES, KEYS, OTHER_ENV, all_keys, env_var
from hicached.config.sections import SECTION_TYPES, Config

__all__ = ["as_dict", "describe", "to_toml", "toml_value", "unknown_env"]


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value


def as_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """TOML-ready nested dict (paths as strings; backend tables as nested dicts, unset options left out)."""
    out: dict[str, dict[str, Any]] = {}
    for name in SECTION_TYPES:
        section = getattr(cfg, name)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if "show" in f.metadata:
                values[f.name] = f.metadata["show"](v)
            elif dataclasses.is_dataclass(v):
                values[f.name] = {
                    g.name: _plain(getattr(v, g.name))
                    for g in dataclasses.fields(v)
                    if getattr(v, g.name) is not None
                }
            else:
                values[f.name] = _plain(v)
        out[name] = values
    return out


def toml_value(key: str, value: Any) -> str:
    """``value`` of ``key`` as TOML text (modes in octal: ``0o660``)."""
    entry = KEYS.get(key)
    if entry is not None and entry[0].metadata.get("mode") and isinstance(value, int):
        return format_mode(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value("", v) for v in value) + "]"
    return json.dumps(str(value))


def to_toml(cfg: Config) -> str:
    """The configuration as a TOML document that :func:`resolve` reads back to ``cfg``."""
    lines: list[str] = []
    for section, values in as_dict(cfg).items():
        lines.append(f"[{section}]")
        tables = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines += [f"{k} = {toml_value(f'{section}.{k}', v)}" for k, v in values.items() if k not in tables]
        lines.append("")
        for table, options in tables.items():
            lines.append(f"[{section}.{table}]")
            lines += [f"{k} = {toml_value(f'{section}.{table}.{k}', v)}" for k, v in options.items()]
            lines.append("")
    return "\n".join(lines)


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``HICACHED_*`` variable that is no configuration key (a typo is never silent)."""
    env = os.environ if env is None else env
    known = {env_var(k) for k in KEYS} | {env_var(a) for a in ALIASES} | set(OTHER_ENV)
    warnings = []
    for name in sorted(env):
        if not name.startswith("HICACHED_") or name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else "; see `hicached config show --keys`"
        # repr of a prefix: the name is anyone's, and a terminal would obey its escapes.
        shown = repr(name[:60]) + (f"... ({len(name)} chars)" if len(name) > 60 else "")
        warnings.append(f"environment variable {shown} is not a hicached setting and is ignored{hint}")
    return warnings


def describe() -> list[tuple[str, str, str, str]]:
    """(key, default, env var, help) for every key, for docs and ``config show --keys``.

    Defaults are written as in TOML (``0o660``, ``"text"``, ``true``); an option without
    a value (``None``) is ``unset``.
    """
    rows = []
    defaults = as_dict(Config())
    for key, f, _ in all_keys():
        value: Any = defaults
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        shown = "unset" if value is None else toml_value(key, value)
        rows.append((key, shown, env_var(key), f.metadata.get("help", "")))
    return rows
