"""Ownership records of host segments: a crashed daemon's segments are reclaimed, never guessed.

Each daemon holds ``{SHM_DIR}/{prefix}-{daemon_id}.owner`` locked with
``flock(LOCK_EX)`` for its whole lifetime; its cold-mode segments are named
``{prefix}-{daemon_id}-...``. The kernel drops the lock when the process dies,
whatever kills it (SIGKILL, OOM), so a record that *exists and can be locked
by somebody else* proves its owner is gone. :func:`reclaim_dead` unlinks that
owner's segments and then the record. A segment without a record is never
touched: nothing proves its owner dead (another prefix, an older daemon, a
warm-restart segment, which the journal logic owns).

The record lives in ``SHM_DIR`` itself, so it shares the segments' namespace
(a container with its own ``/dev/shm`` sees only its own daemons). A plain host's is
writable by every local user: a record or segment that is not a regular file of the daemon's
uid is somebody else's, never opened as a record (a FIFO blocked ``open``), nor unlinked.

Atomicity: the record is created under a temporary name, locked, and only then
renamed into place, so the final name never refers to an unlocked file of a
live daemon (no window in which a starting daemon looks dead).
Thread-safety: :class:`OwnerRecord` is used by its one owner (the group
registry); :func:`reclaim_dead` may run in several daemons at once: whoever
wins the record's lock does the reclaiming, the others see it held.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
from dataclasses import dataclass

from hicached.errors import FailedPrecondition
from hicached.shm import SHM_DIR

__all__ = ["OwnerRecord", "Reclaimed", "reclaim_dead"]

logger = logging.getLogger(__name__)

_SUFFIX = ".owner"


def _record_name(prefix: str, daemon_id: str) -> str:
    return f"{prefix}-{daemon_id}{_SUFFIX}"


class OwnerRecord:
    """This daemon's locked ownership record (see the module docstring)."""

    def __init__(self, prefix: str, daemon_id: str, *, directory: str = SHM_DIR) -> None:
        if not re.fullmatch(r"[0-9A-Za-z]+", daemon_id):
            raise FailedPrecondition(f"daemon id {daemon_id[:32]!r} must be alphanumeric")
        self.path = os.path.join(directory, _record_name(prefix, daemon_id))
        tmp = os.path.join(directory, f".{_record_name(prefix, daemon_id)}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise FailedPrecondition(f"cannot create the ownership record {tmp}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())  # for humans; the lock is the proof
            if os.path.exists(self.path):
                raise FailedPrecondition(f"ownership record {self.path} already exists (daemon id reused)")
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the record and drop the lock (clean shutdown, segments already gone). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # unlink before unlocking: nobody may reclaim a live record's name
        os.close(fd)


@dataclass(frozen=True)
class Reclaimed:
    """What :func:`reclaim_dead` removed: ``(segment name, bytes)`` per segment, and the dead ids."""

    segments: tuple[tuple[str, int], ...]
    owners: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.segments)


def reclaim_dead(prefix: str, *, directory: str = SHM_DIR) -> Reclaimed:
    """Unlink the segments of every daemon of ``prefix`` whose record proves it dead; log them.

    Records of live daemons (their lock is held) and segments without a record
    are left alone. Never raises for a vanished file (another daemon may be
    reclaiming at the same time).
    """
    pattern = re.compile(rf"{re.escape(prefix)}-([0-9A-Za-z]+){re.escape(_SUFFIX)}")
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return Reclaimed((), ())
    freed: list[tuple[str, int]] = []
    owners: list[str] = []
    for record in names:
        m = pattern.fullmatch(record)
        if m is None:
            continue
        path = os.path.join(directory, record)
        fd = _open_record(path)
        if fd is None:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive (or being reclaimed by another daemon right now)
            if not _same_file(fd, path):
                continue  # reclaimed and removed by another daemon between listdir and open
            daemon_id = m.group(1)
            # Exactly the cold-mode names ``{prefix}-{daemon id}-{16 hex group id}-{pool}``,
            # so a daemon whose prefix merely starts like ours is never matched.
            mine = re.compile(rf"{re.escape(prefix)}-{daemon_id}-[0-9a-f]{{16}}-.+")
            for name in sorted(os.listdir(directory)):
                if mine.fullmatch(name):
                    seg = os.path.join(directory, name)
                    try:
                        st = os.lstat(seg)
                        if st.st_uid != os.geteuid():
                            continue  # not a segment of ours: another user's name in a shared SHM_DIR
                        os.unlink(seg)
                    except FileNotFoundError:
                        continue
                    except OSError as exc:  # EPERM, say: never a reason not to start
                        logger.warning("cannot reclaim host segment %s: %s", seg, exc.strerror)
                        continue
                    size = st.st_size
                    freed.append((name, size))
            with contextlib.suppress(OSError):
                os.unlink(path)
            owners.append(daemon_id)
        finally:
            os.close(fd)
    result = Reclaimed(tuple(freed), tuple(owners))
    if owners:
        logger.warning(
            "reclaimed %d host segment(s), %d bytes, of %d dead daemon(s) of prefix %r: %s",
            len(freed),
            result.nbytes,
            len(owners),
            prefix,
            ", ".join(f"{name} ({size} bytes)" for name, size in freed) or "none",
            extra={"event": "reclaim", "segments": [n for n, _ in freed], "bytes": result.nbytes},
        )
    return result


def _open_record(path: str) -> int | None:
    """A descriptor of the ownership record at ``path``, or None (logged) for one that is not a
    regular file of this daemon's uid: ``SHM_DIR`` is usually writable by every local user, and
    a FIFO there blocked a plain ``open`` (every daemon of the prefix hung at startup), an
    unreadable one raised (a non-root daemon could not start)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("ignoring ownership record %s: %s", path, exc.strerror)
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        logger.warning(
            "ignoring ownership record %s: not a regular file owned by uid %d (another user's?)",
            path,
            os.geteuid(),
        )
        return None
    return fd


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
