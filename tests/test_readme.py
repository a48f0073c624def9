"""The README stays true: quick start, configuration reference, and its worker example runs."""

from __future__ import annotations

import re
from pathlib import Path

from hicached.config import describe

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def test_quick_start_is_two_commands_and_ci_runs_the_test_one() -> None:
    block = re.search(r"```bash\n(.*?)```", _section("Quick start"), re.S)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["./dev serve", "./dev test"]
    assert "./dev test" in (ROOT / ".ci" / "run").read_text()


def test_every_configuration_key_is_documented_with_its_env_var() -> None:
    reference = _section("Configuration")
    for key, _default, env, _help in describe():
        assert f"| `{key}` |" in reference, key
        assert f"`{env}`" in reference, env


# Defaults computed at start (from XDG_* and the uid), written in prose in the table.
COMPUTED_DEFAULTS = {"server.socket", "host.journal_dir", "l3.file.path"}


def test_every_configuration_default_is_the_one_config_show_prints() -> None:
    """Before: `''` and `False` where `config show --keys` prints `""` and `false`."""
    reference = _section("Configuration")
    for key, default, _env, _help in describe():
        if key in COMPUTED_DEFAULTS:
            continue
        row = f"| `{key}` | `{default}`"
        assert row in reference, (row, "the README's default differs from describe()")


def test_every_command_has_a_row_in_the_commands_table() -> None:
    """Before: `hicached lookup` existed but had no row."""
    import argparse

    from hicached.cli import build_parser

    table = _section("Commands")
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in subparsers.choices:
        assert f"| `hicached {name}" in table, name


def test_every_command_line_flag_is_documented() -> None:
    """Before: `keys --full-pages-only`, `config show --format`, `status --target/--timeout` and
    `lookup`'s layout flags were in no document."""
    import argparse

    from hicached.cli import build_parser

    docs = README + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    missing = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(subparser, f"{name} {sub}")
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and not re.search(rf"{flag}(?![\w-])", docs):
                    missing.append(f"{name} {flag}")

    walk(build_parser(), "hicached")
    assert not missing, missing
