"""The L3 backend's stats as of the last background refresh.

A backend's ``stats()`` may do network I/O (S3 LISTs the bucket, Redis runs
INFO and DBSIZE) and hangs when the backend does; GetStats and ``hicached
status`` must answer anyway. So GetStats reads :meth:`StatsCache.get` (no I/O)
and a supervised daemon task calls :meth:`StatsCache.step` every
``l3.stats_interval_s``, which runs the refresh on the cache's own thread. A
refresh that hangs holds only that thread; later steps skip while it runs (and
log how long), so nothing queues behind it.

Thread-safety: ``get`` and ``refresh`` may run on any thread (one lock);
``step`` runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from hicached.l3.base import BackendStats, StorageBackend

__all__ = ["StatsCache"]

logger = logging.getLogger(__name__)


class StatsCache:
    def __init__(self, name: str, backend: StorageBackend) -> None:
        self.name = name
        self._backend = backend
        self._lock = threading.Lock()
        self._stats: BackendStats | None = None
        self._refreshed_at = 0.0  # monotonic time of the last successful refresh
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicached-l3-stats")
        self._running: Future[None] | None = None
        self._started_at = 0.0

    def get(self) -> tuple[str, BackendStats | None, float | None]:
        """(backend name, last stats or None before the first refresh, their age in seconds)."""
        with self._lock:
            stats, at = self._stats, self._refreshed_at
        return self.name, stats, (time.monotonic() - at) if stats is not None else None

    def refresh(self) -> None:
        """Ask the backend (blocking I/O; never on the event loop)."""
        stats = self._backend.stats()
        with self._lock:
            self._stats, self._refreshed_at = stats, time.monotonic()

    async def step(self, wait_s: float = 1.0) -> None:
        """One supervised tick: report the last refresh's failure (the supervisor logs it and
        backs off), or start a refresh unless the last one still runs; wait for it at most
        ``wait_s`` (a hung backend is noticed by the next tick, never awaited forever)."""
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
        loop = asyncio.get_running_loop()
        finished = asyncio.Event()
        self._started_at = time.monotonic()
        fut = self._thread.submit(self.refresh)

        def wake(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
                loop.call_soon_threadsafe(finished.set)

        fut.add_done_callback(wake)
        self._running = fut
        try:
            await asyncio.wait_for(finished.wait(), wait_s)
        except TimeoutError:
            return
        self._running = None
        fut.result()

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
