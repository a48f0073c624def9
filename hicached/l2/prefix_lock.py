"""The lock that makes one warm-restart daemon the only one of its ``shm_prefix`` on a ``/dev/shm``.

Warm-restart segment names (``{prefix}-{group id}-{pool}``) carry no daemon id, and the journal
lock lives in ``host.journal_dir``: two daemons with one prefix and two journal directories
both started, and the second unlinked the first one's live segments as "left without a
journal", then made its own under the same names, which the first one's journals named at its
next clean stop (the next daemon would have replayed one daemon's index over the other's pages).
:class:`ShmPrefixLock` holds ``{SHM_DIR}/{prefix}.warm.lock`` with ``flock(LOCK_EX)`` for the
daemon's life, in the namespace the segments share.

``SHM_DIR`` is usually writable by every local user: the file is opened ``O_NOFOLLOW |
O_NONBLOCK`` and used only when it is a regular file of this daemon's uid. One of another uid
(planted first) is logged and not used -- the journal lock still holds -- so a stranger can
turn this check off, never stop the daemon from starting.

Atomicity: the lock is taken on the file the name refers to after the lock is held (checked
by inode), and :meth:`ShmPrefixLock.release` unlinks the name before it unlocks, so two daemons
never both hold a name (as :class:`hicached.l2.owners.OwnerRecord`).
Thread-safety: one owner (the journal store) acquires and releases it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat

from hicached.errors import FailedPrecondition
from hicached.shm import SHM_DIR

__all__ = ["ShmPrefixLock"]

logger = logging.getLogger(__name__)

_TRIES = 8  # each retry means another daemon released the name between our open and lock


class ShmPrefixLock:
    """``{directory}/{prefix}.warm.lock``, held (see the module docstring)."""

    def __init__(self, prefix: str, *, directory: str = SHM_DIR) -> None:
        self.prefix = prefix
        self.path = os.path.join(directory, f"{prefix}.warm.lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        """Hold the lock; FailedPrecondition when another live daemon holds it. Idempotent."""
        if self._fd is not None:
            return
        for _ in range(_TRIES):
            try:
                fd = os.open(
                    self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600
                )
            except OSError as exc:
                logger.warning("warm-restart prefix lock %s not used: %s", self.path, exc.strerror)
                return
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                os.close(fd)
                logger.warning(
                    "warm-restart prefix lock %s not used: not a regular file owned by uid %d "
                    "(uid %d's); give the daemon its own /dev/shm",
                    self.path,
                    os.geteuid(),
                    st.st_uid,
                )
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise FailedPrecondition(
                    f"another daemon uses warm-restart prefix {self.prefix!r} ({self.path} is locked), "
                    "with another host.journal_dir; give each daemon its own host.shm_prefix"
                ) from None
            if _same_file(fd, self.path):
                self._fd = fd
                return
            os.close(fd)  # released (unlinked) by its last holder meanwhile: open the new name
        raise FailedPrecondition(f"warm-restart prefix lock {self.path} keeps changing; try again")

    def release(self) -> None:
        """Unlink the name, then drop the lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
