"""Who could re-point a path: the one ownership walk the daemon's path checks share.

The socket directory (:mod:`hicached.server.sockets`), the warm-restart journal directory
(:mod:`hicached.core.journal`) and the credential files (:mod:`hicached.server.credentials`)
are trusted only when nobody but root and the daemon's uid owns a directory or symlink on the
way to them, the way the kernel resolves it (:mod:`hicached_client.pathwalk`, the walk the
client's socket check shares): the owner of one can rename what it holds or re-point it.
Write bits are each caller's own rule (``/tmp`` is root's, 1777 and sticky; a pod's emptyDir
0777). Pure: reads ``lstat`` and ``readlink`` only; thread-safe.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from hicached_client.pathwalk import Walk, walk

__all__ = ["Foreign", "foreign_in", "foreign_on_path"]


@dataclass(frozen=True)
class Foreign:
    """A directory or symlink on the path owned by an untrusted uid."""

    path: Path
    uid: int
    symlink: bool

    @property
    def kind(self) -> str:
        return "a symlink" if self.symlink else "a directory"


def foreign_on_path(directory: Path, trusted: Collection[int], *, itself: bool) -> Foreign | None:
    """:func:`foreign_in` the kernel's walk of ``directory`` (:func:`hicached_client.pathwalk.walk`).
    OSError when the path cannot be walked (a loop, a file passed through, a directory this uid
    cannot search)."""
    return foreign_in(walk(str(directory)), trusted, itself=itself)


def foreign_in(way: Walk, trusted: Collection[int], *, itself: bool) -> Foreign | None:
    """The first directory or symlink of ``way`` owned by a uid not in ``trusted``; None when
    there is none. ``way`` holds every directory the path passes through and every symlink it
    follows, ``..`` and symlinks met half-way included; parts that did not exist ended it (the
    caller makes them). Its final entry is checked when ``itself`` (a symlink always is). A
    caller that goes on to use what it judged judges this one walk for everything it checks:
    two walks may see two layouts."""
    for step in way.steps:
        if step is way.final and not itself:
            continue
        if step.st.st_uid not in trusted:
            return Foreign(Path(step.path), step.st.st_uid, step.symlink)
    return None
