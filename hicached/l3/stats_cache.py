"""The L3 backend's stats, refreshed off the event loop, with a deadline.

A backend's ``stats()`` may do network I/O (S3 LISTs the bucket, Redis runs
INFO and DBSIZE) and hangs when the backend does; GetStats and ``hicached
status`` must answer anyway. Refreshes run on the cache's own thread, one at a
time: a supervised daemon task starts one every ``l3.stats_interval_s``
(:meth:`StatsCache.step`), and GetStats (:meth:`StatsCache.current`) starts one
when none runs and waits for it at most ``l3.stats_wait_s``, then answers the
last stats it has. A refresh that hangs holds only that thread; nothing queues
behind it (later ticks log how long it has run, ``l3_stats_slow``).

Thread-safety: ``get`` and ``refresh`` may run on any thread (one lock);
``step`` and ``current`` run on the event loop (the in-flight refresh is
loop-confined).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from hicached.l3.base import BackendStats, StorageBackend

__all__ = ["L3Stats", "StatsCache"]

logger = logging.getLogger(__name__)


class L3Stats(NamedTuple):
    """What GetStats answers of the backend."""

    name: str
    stats: BackendStats | None  # the last a refresh gave; None before the first did
    age_s: float | None  # since then; None with no stats
    error: str  # why the last refresh failed ("" when it succeeded)


class StatsCache:
    def __init__(self, name: str, backend: StorageBackend) -> None:
        self.name = name
        self._backend = backend
        self._lock = threading.Lock()
        self._stats: BackendStats | None = None
        self._refreshed_at = 0.0  # monotonic time of the last successful refresh
        self._error = ""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicached-l3-stats")
        self._running: Future[None] | None = None
        self._started_at = 0.0

    def get(self) -> L3Stats:
        with self._lock:
            stats, at, error = self._stats, self._refreshed_at, self._error
        return L3Stats(self.name, stats, (time.monotonic() - at) if stats is not None else None, error)

    def refresh(self) -> None:
        """Ask the backend (blocking I/O; never on the event loop). A failure is kept for
        GetStats to show (the backend is down) and raised for the caller to report."""
        try:
            stats = self._backend.stats()
        except Exception as exc:
            with self._lock:
                self._error = (str(exc) or type(exc).__name__)[:200]
            raise
        with self._lock:
            self._stats, self._refreshed_at, self._error = stats, time.monotonic(), ""

    def _start(self) -> Future[None]:
        self._started_at = time.monotonic()
        self._running = self._thread.submit(self.refresh)
        return self._running

    @staticmethod
    async def _settle(fut: Future[None], wait_s: float) -> bool:
        """Wait for ``fut`` at most ``wait_s``; True when it finished (its outcome unread)."""
        if fut.done() or wait_s <= 0:
            return fut.done()
        loop = asyncio.get_running_loop()
        finished = asyncio.Event()

        def wake(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
                loop.call_soon_threadsafe(finished.set)

        fut.add_done_callback(wake)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished.wait(), wait_s)
        return fut.done()

    async def current(self, wait_s: float) -> L3Stats:
        """The freshest stats GetStats may answer: a refresh (the running one, or a new one)
        gets at most ``wait_s``; past that, the last stats (a hung backend costs ``wait_s``)."""
        fut = self._running
        if fut is None or fut.done():
            if fut is not None and not fut.cancelled() and fut.exception() is not None:
                logger.warning("L3 stats refresh failed: %s", fut.exception(), extra={"event": "l3_stats"})
            fut = self._start()
        await self._settle(fut, wait_s)
        return self.get()

    async def step(self, wait_s: float = 1.0) -> None:
        """One supervised tick: report the last refresh's failure (the supervisor logs it and
        backs off), or start a refresh unless one still runs, and wait for it at most ``wait_s``
        (a hung backend is noticed by the next tick, never awaited forever)."""
        running = self._running
        if running is not None:
            if not running.done():
                logger.warning(
                    "L3 stats refresh still running after %.1f s; GetStats answers the last stats",
                    time.monotonic() - self._started_at,
                    extra={"event": "l3_stats_slow", "backend": self.name},
                )
                return
            self._running = None
            running.result()  # the failure of a refresh that finished after its tick
        fut = self._start()
        if await self._settle(fut, wait_s):
            self._running = None
            fut.result()

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
