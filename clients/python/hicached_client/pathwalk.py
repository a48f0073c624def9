"""Who could re-point a path: a path resolved as the kernel resolves it, every step kept.

The daemon's path checks (its socket and journal directories, its credential files:
``hicached.paths``) and the client's check of the daemon's socket directory
(:mod:`hicached_client._handoff`) judge the owner, and some the mode, of everything whose
owner could rename or re-point what a path reaches. Judging the text of the path, or only the
path as given and its ``realpath``, misses two kinds of step: ``link/..`` is the parent of what
``link`` points to, not the directory holding ``link``, and a symlink met half-way through a
chain of them is on neither the given nor the resolved path. So :func:`walk` resolves one
component at a time from ``/``: it reads each symlink it meets and walks its target in turn,
and ``..`` goes to the parent of the directory actually reached. It returns every directory
passed through and every symlink followed, in the order met.

Pure: ``lstat`` and ``readlink`` only (nothing is opened); thread-safe. What it returns is what
the file system held while it ran: a caller that then opens the path relies on its own rule
(no directory on the way writable by a stranger) to keep it so.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

__all__ = ["MAX_LINKS", "Step", "Walk", "walk"]

# The kernel's own bound on symlinks followed in one resolution (ELOOP past it).
MAX_LINKS = 40


@dataclass(frozen=True)
class Step:
    """One thing the resolution went through: a directory, a symlink, or the final entry."""

    path: str  # where the walk met it: a symlink-free directory path and its name
    st: os.stat_result  # its lstat

    @property
    def symlink(self) -> bool:
        return stat.S_ISLNK(self.st.st_mode)

    @property
    def directory(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)


@dataclass(frozen=True)
class Walk:
    """What :func:`walk` found. ``reached``: the symlink-free path the whole path resolves to,
    or, when a component does not exist, the directory that would hold it. ``remaining``: the
    components not walked, the missing one first (empty when the whole path exists)."""

    steps: tuple[Step, ...]
    reached: str
    remaining: tuple[str, ...]

    @property
    def final(self) -> Step | None:
        """The entry the whole path resolves to (never a symlink), None when it does not exist."""
        return None if self.remaining else self.steps[-1]

    @property
    def missing(self) -> str | None:
        """The full path of the first component that does not exist; None when none is missing."""
        return os.path.join(self.reached, self.remaining[0]) if self.remaining else None


def walk(path: str) -> Walk:
    """Resolve ``path`` (relative to the working directory unless absolute) one component at a
    time; see the module docstring. OSError: ``ELOOP`` past :data:`MAX_LINKS` symlinks,
    ``ENOTDIR`` when a component that is not a directory is passed through, or what ``lstat``
    or ``readlink`` raise (``EACCES`` for a directory this uid cannot search)."""
    if not os.path.isabs(path):
        path = os.path.join(os.getcwd(), path)  # getcwd() is already symlink-free
    pending = [part for part in reversed(path.split("/")) if part not in ("", ".")]
    current = "/"
    steps = [Step("/", os.lstat("/"))]
    links = 0
    while pending:
        name = pending.pop()
        if name == "..":
            # The parent of the directory reached, which the walk passed through on its way.
            current = os.path.dirname(current)
            continue
        at = os.path.join(current, name)
        try:
            st = os.lstat(at)
        except FileNotFoundError:
            return Walk(tuple(steps), current, (name, *reversed(pending)))
        steps.append(Step(at, st))
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(at)
            if target.startswith("/"):
                current = "/"
            pending.extend(part for part in reversed(target.split("/")) if part not in ("", "."))
            continue
        if pending and not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), at)
        current = at
    return Walk(tuple(steps), current, ())
