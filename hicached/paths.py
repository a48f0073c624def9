"""Who could re-point a path: the one ownership walk the daemon's path checks share.

The socket directory (:mod:`hicached.server.sockets`) and the warm-restart journal directory
(:mod:`hicached.core.journal`) are trusted only when nobody but root and the daemon's uid owns
a directory or symlink on the way to them, as given and as resolved: the owner of one can
rename what it holds or re-point it. Write bits are each caller's own rule (``/tmp`` is root's,
1777 and sticky; a pod's emptyDir 0777). Pure: reads ``lstat`` only; thread-safe.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Foreign", "foreign_on_path"]


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
    """The first directory or symlink on the way to ``directory`` (as given, then as resolved)
    owned by a uid not in ``trusted``; None when there is none. Parts that do not exist yet are
    skipped (the caller makes them). ``directory`` itself is checked when ``itself``, and always
    when it is a symlink (its target is the resolved path's)."""
    given = Path(os.path.abspath(directory))
    for path in (given, Path(os.path.realpath(given))):
        for part in (*reversed(path.parents), path):
            try:
                st = os.lstat(part)
            except FileNotFoundError:
                continue
            symlink = stat.S_ISLNK(st.st_mode)
            if part == path and not itself and not symlink:
                continue
            if st.st_uid not in trusted:
                return Foreign(part, st.st_uid, symlink)
    return None
