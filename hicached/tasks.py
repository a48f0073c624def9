"""Supervision of the daemon's periodic background tasks: none of them dies silently.

:func:`supervise` runs a step every ``interval_s`` on the event loop. A step
that raises is logged (with its traceback, unless it is :class:`Unavailable`: an outage, such
as an L3 backend's, says what it is in its message), counted (``on_failure``), and
retried after a backoff that doubles per consecutive failure up to
``max_backoff_s``; the first success resets it. A task where continuing would
be wrong is marked ``fatal``: its first failure calls ``on_fatal`` (the daemon
stops) instead of retrying. Cancellation (daemon shutdown) ends the task.

Runs on the asyncio loop; ``step`` must be cheap and non-blocking (hand
blocking work to an executor inside it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from hicached.errors import Unavailable

__all__ = ["supervise"]

logger = logging.getLogger(__name__)


async def supervise(
    name: str,
    step: Callable[[], Awaitable[None] | None],
    *,
    interval_s: float,
    max_backoff_s: float = 30.0,
    fatal: bool = False,
    on_failure: Callable[[str], None] | None = None,
    on_fatal: Callable[[str, BaseException], None] | None = None,
) -> None:
    """Run ``step`` every ``interval_s`` seconds until cancelled (see the module docstring)."""
    failures = 0
    while True:
        try:
            result = step()
            if result is not None:
                await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failures += 1
            if on_failure is not None:
                on_failure(name)
            if fatal:
                logger.critical(
                    "background task %s failed; stopping the daemon",
                    name,
                    exc_info=True,
                    extra={"event": "task_failed", "task": name},
                )
                if on_fatal is not None:
                    on_fatal(name, exc)
                return
            delay = min(interval_s * (2 ** min(failures, 16)), max_backoff_s)
            logger.error(
                "background task %s failed (%d in a row): %s; retrying in %.1fs",
                name,
                failures,
                exc,
                delay,
                exc_info=not isinstance(exc, Unavailable),
                extra={"event": "task_failed", "task": name, "failures": failures, "retry_s": delay},
            )
            await asyncio.sleep(delay)
            continue
        if failures:
            logger.info(
                "background task %s recovered after %d failures",
                name,
                failures,
                extra={"event": "task_recovered", "task": name},
            )
            failures = 0
        await asyncio.sleep(interval_s)
