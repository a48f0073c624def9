"""Rate-limited logging of writes the daemon refused, with the daemon's reason.

A refused write (``PutPages`` with ``ok=false``, ``PutBytes`` answered
``RESOURCE_EXHAUSTED``) is an expected outcome under memory pressure: SGLang
only sees ``False``. The operator sees why in the log, once per ``interval_s``
at most, with the number of refusals folded into that line.

Thread-safe (SGLang's backup thread and the scheduler may both write).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hicached_client.errors import escape_controls

# One line per this many seconds at most (the first refusal is always logged).
DEFAULT_INTERVAL_S = 10.0


REFUSED = "hicached: daemon refused to store %d pages of pool %s: %s%s"


class RefusalLog:
    """Logs ``template % (pages, what, reason, folded)`` at WARNING, rate-limited.

    The default template reads ``hicached: daemon refused to store N pages of
    pool P: <reason>``.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        template: str = REFUSED,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._template = template
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._suppressed = 0
        self.total = 0

    def refused(self, what: str, pages: int, reason: str) -> None:
        """Record one refused write of ``pages`` pages of ``what`` (a pool name)."""
        with self._lock:
            self.total += 1
            now = self._clock()
            if self._last is not None and now - self._last < self._interval_s:
                self._suppressed += 1
                return
            folded, self._suppressed, self._last = self._suppressed, 0, now
        more = f" ({folded} more since the last report)" if folded else ""
        self._log.warning(
            self._template,
            pages,
            what,
            escape_controls(reason) if reason else "no reason given",  # the daemon's text
            more,
        )
