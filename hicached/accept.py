"""What the daemon's own listeners share at accept: pause on exhaustion, log a streak once;
count a client uid's connections and refuse one past its limit.

The fd handoff, fast-lane and metrics listeners each accept on a socket of their own. Out of
descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) a listening socket stays readable, so
accepting again at once spins a core and writes a line per try (~40,000 a second, review 28):
the listener pauses :data:`ACCEPT_PAUSE_S` instead (the kernel's backlog holds the callers)
and :class:`AcceptPauses` logs the streak once, then at most every :data:`LOG_EVERY_S`. Any
other failure (ECONNABORTED: the caller left) is one caller's, logged at debug, no pause.

The fd handoff and the fast lane also bound the connections one client uid has under way
(:class:`UidSlots`): the uid is the kernel's (``SO_PEERCRED``), so one local user cannot hold
every slot and lock the others out; one past the limit is answered with the listeners'
refusal line (``error RESOURCE_EXHAUSTED <reason>``) and closed (:func:`refuse`).

Thread-safety: an :class:`AcceptPauses` is fed by its listener's one thread (or event loop);
:attr:`AcceptPauses.count` may be read from any thread (an int). :class:`UidSlots` is
thread-safe (see there).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["ACCEPT_PAUSE_S", "LOG_EVERY_S", "NO_UID", "AcceptPauses", "UidSlots", "peer_ids", "refuse"]

logger = logging.getLogger(__name__)

# Seconds a listener pauses after an accept that ran out of descriptors or memory.
ACCEPT_PAUSE_S = 0.1
# At most one warning per this many seconds about a listener's paused accepts.
LOG_EVERY_S = 10.0
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class AcceptPauses:
    """The accept failures of one listener (``what`` names it in the log, ``event`` tags it)."""

    def __init__(self, what: str, event: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._what = what
        self._event = event
        self._clock = clock
        self._last_log = -LOG_EVERY_S
        self.count = 0  # pauses so far

    def failed(self, exc: OSError) -> bool:
        """Note a failed accept; True when the listener must pause :data:`ACCEPT_PAUSE_S`
        (out of resources: counted, the streak logged at most every :data:`LOG_EVERY_S`),
        False when it was one caller's failure and accepting goes on."""
        if exc.errno not in _OUT_OF_RESOURCES:
            logger.debug("%s accept failed: %s", self._what, exc)
            return False
        self.count += 1
        now = self._clock()
        if now - self._last_log >= LOG_EVERY_S:
            logger.warning(
                "%s accept failed: %s; pausing %.1f s each time (%d pauses so far)",
                self._what,
                exc,
                ACCEPT_PAUSE_S,
                self.count,
                extra={"event": self._event, "pauses": self.count},
            )
            self._last_log = now
        return True


# The uid bucket of a connection whose credentials cannot be read: all such share one.
NO_UID = -1


def peer_ids(sock: socket.socket) -> tuple[int, int, int]:
    """``SO_PEERCRED`` of a connected Unix socket: (pid, uid, gid), as the kernel recorded them
    at connect (the client cannot forge them). OSError when they cannot be read."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def refuse(conn: socket.socket, line: str) -> None:
    """Send a listener's refusal ``line`` (``error <STATUS_CODE> <reason>\\n``) and close
    ``conn`` (owned by the caller until now). A peer already gone is no failure: it is closed
    all the same."""
    with contextlib.suppress(OSError):
        conn.send(line.encode())
    conn.close()


class UidSlots:
    """Connections under way per client uid, at most ``limit`` each.

    A listener calls :meth:`take` at accept, before any work for the connection, and
    :meth:`release` with the uid it got once the connection is done (exactly once per slot
    taken). The refusal says ``uid <uid> already has <limit> <what>; <advice>``.

    Thread-safety: one lock guards the counts, so :meth:`take` and :meth:`release` may be
    called from any thread: the fast lane's acceptor thread takes and its lane threads
    release; the fd handoff takes and releases on its event loop (the lock is uncontended
    there, and held for a dict update only: never across a syscall).
    """

    def __init__(self, limit: int, what: str, advice: str) -> None:
        self._limit = limit
        self._what = what
        self._advice = advice
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}

    def take(self, conn: socket.socket) -> tuple[int, str | None]:
        """The uid of ``conn`` (:data:`NO_UID` without credentials: one shared bucket) and, when
        it already has ``limit`` slots, the refusal line to send (no slot taken); else a slot
        is counted and the line is None."""
        try:
            uid = peer_ids(conn)[1]
        except OSError:
            uid = NO_UID
        with self._lock:
            held = self._counts.get(uid, 0)
            if held >= self._limit:
                return uid, (
                    f"error RESOURCE_EXHAUSTED uid {uid} already has {self._limit} {self._what}; {self._advice}\n"
                )
            self._counts[uid] = held + 1
        return uid, None

    def restore(self, uid: int) -> None:
        """Count again a slot of ``uid`` given back by mistake (within the limit when taken)."""
        with self._lock:
            self._counts[uid] = self._counts.get(uid, 0) + 1

    def release(self, uid: int) -> None:
        """Give back one slot of ``uid`` (taken by :meth:`take`); zero counts are dropped."""
        with self._lock:
            left = self._counts.get(uid, 0) - 1
            if left > 0:
                self._counts[uid] = left
            else:
                self._counts.pop(uid, None)
