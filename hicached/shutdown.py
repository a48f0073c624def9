"""One shutdown budget: ``server.grace_s`` bounds the whole drain on SIGTERM.

The order is fixed: stop serving (in-flight RPCs get at most :data:`RPC_SHARE` of the
budget), then flush queued L3 backups of every content index until the deadline, then
write the warm-restart journals (local disk, not bounded here). Before this, the RPC stop
and *each* index's flush got the full ``grace_s``, so a daemon with several pool groups
could outrun the pod's ``terminationGracePeriodSeconds`` and be SIGKILLed before its
journal was written. Pods keep ``terminationGracePeriodSeconds >= grace_s +``
:data:`JOURNAL_MARGIN_S` (docs/deploy.md, "Shutdown budget").

Pure apart from calling ``flush``; runs on one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from hicached.errors import ResourceExhausted, Unavailable

logger = logging.getLogger(__name__)

__all__ = ["JOURNAL_MARGIN_S", "RPC_SHARE", "Flushable", "flush_within", "rpc_grace_s"]

# Share of server.grace_s that in-flight RPCs get before they are cancelled.
RPC_SHARE = 0.5
# Seconds the pod's grace period must leave after grace_s: journals, unmapping, exit.
JOURNAL_MARGIN_S = 15.0


class Flushable(Protocol):
    def flush(self, timeout_s: float | None = None) -> int: ...


def rpc_grace_s(budget_s: float) -> float:
    """Seconds in-flight RPCs get at stop, out of the whole budget."""
    return max(0.0, budget_s * RPC_SHARE)


def flush_within(
    indexes: Iterable[Flushable], deadline: float, *, clock: Callable[[], float] = time.monotonic
) -> int:
    """Flush each index with what is left until ``deadline`` (a ``clock`` time); pages flushed.

    An index that cannot finish in time, and every index after the deadline, is logged
    and skipped: what L3 acknowledged before the deadline survives, the rest stays in L2
    (and in the journal, under warm restart).
    """
    flushed = 0
    for index in indexes:
        remaining = deadline - clock()
        if remaining <= 0:
            logger.warning(
                "shutdown budget spent before every L3 flush; set server.grace_s higher",
                extra={"event": "shutdown"},
            )
            break
        try:
            flushed += index.flush(remaining)
        except (ResourceExhausted, Unavailable) as exc:
            logger.warning("shutdown flush incomplete: %s", exc, extra={"event": "shutdown"})
    return flushed
