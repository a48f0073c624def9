"""A small Dockerfile reader for the tests: stages, instructions, exec-form arguments."""

from __future__ import annotations

import fnmatch
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY...
    value: str  # the rest, continuation lines joined

    def exec_form(self) -> list[str]:
        """The instruction's arguments as a list (JSON form, or shell words)."""
        text = self.value.strip()
        if text.startswith("["):
            parsed = json.loads(text)
            assert isinstance(parsed, list)
            return [str(p) for p in parsed]
        return shlex.split(text)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def last(self, keyword: str) -> Instruction | None:
        found = [i for i in self.instructions if i.keyword == keyword]
        return found[-1] if found else None

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse(path: Path) -> list[Stage]:
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[Stage] = []
    for line in logical:
        keyword, _, value = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = value.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif stages:
            stages[-1].instructions.append(Instruction(keyword, value.strip()))
    return stages


def dockerignore_excludes(patterns: list[str], relpath: str) -> bool:
    """Whether Docker leaves ``relpath`` out of the build context (last match wins)."""
    excluded = False
    parts = relpath.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.rstrip("/")
        regex_body = body.replace("**/", "*") if body.startswith("**/") else body
        if any(
            fnmatch.fnmatchcase(c, body) or fnmatch.fnmatchcase(c.split("/")[-1], regex_body)
            for c in candidates
        ):
            excluded = not negate
    return excluded


def read_dockerignore(path: Path) -> list[str]:
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
