"""What the daemon's own listeners do when an accept fails: pause on exhaustion, log a streak once.

The fd handoff, fast-lane and metrics listeners each accept on a socket of their own. Out of
descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) a listening socket stays readable, so
accepting again at once spins a core and writes a line per try (~40,000 a second, review 28):
the listener pauses :data:`ACCEPT_PAUSE_S` instead (the kernel's backlog holds the callers)
and :class:`AcceptPauses` logs the streak once, then at most every :data:`LOG_EVERY_S`. Any
other failure (ECONNABORTED: the caller left) is one caller's, logged at debug, no pause.

Thread-safety: an :class:`AcceptPauses` is fed by its listener's one thread (or event loop);
:attr:`AcceptPauses.count` may be read from any thread (an int).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

__all__ = ["ACCEPT_PAUSE_S", "LOG_EVERY_S", "AcceptPauses"]

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
