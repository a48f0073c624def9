"""Separate, bounded thread pools ("lanes") for the kinds of blocking work an RPC does.

The event loop only parses, authorizes and schedules; anything that blocks or is
proportional to a request's size runs on a lane. Each kind has its own threads,
so a hung L3 that holds every L3 thread cannot delay an attach, a heartbeat, the
lease reaper or GetStats (bookkeeping), nor a copy:

* ``copy``: RPCs that wait for the copy engine (Write, Load, PutPages, ...);
* ``l3``: RPCs that wait for the L3 backend (include_l3, Backup, Prefetch, ...),
  with at most ``limits.max_l3_calls_queued`` waiting beyond its threads
  (then RESOURCE_EXHAUSTED naming the key, before any work);
* ``hash``: token-chain hashing and key checks (CPU-bound);
* ``bookkeeping``: attach, stats, the lease reaper, page bookkeeping.

Thread-safety: :meth:`Lane.run` is called on the event loop only (its counter is
loop-confined); the pools themselves are thread-safe.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from hicached.config import Config
from hicached.errors import LimitExceeded

T = TypeVar("T")

__all__ = ["Lane", "Lanes"]


class Lane:
    """One bounded pool; ``max_queued`` (None = unbounded) calls may wait beyond its threads."""

    def __init__(self, name: str, threads: int, *, max_queued: int | None = None, key: str = "") -> None:
        self.name = name
        self.threads = threads
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"hicached-{name}")
        self._max_queued = max_queued
        self._key = key
        self.pending = 0  # calls submitted and not yet finished (event-loop confined)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._max_queued is not None and self.pending >= self.threads + self._max_queued:
            raise LimitExceeded(
                f"{self.pending} calls already wait for the {self.name} lane ({self.threads} threads, "
                f"{self._key}={self._max_queued} may queue): retry later",
                self._key,
            )
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class Lanes:
    copy: Lane
    l3: Lane
    hash: Lane
    bookkeeping: Lane

    @classmethod
    def from_config(cls, config: Config) -> Lanes:
        s, lim = config.server, config.limits
        return cls(
            copy=Lane("copy", s.copy_threads),
            l3=Lane("l3", s.l3_threads, max_queued=lim.max_l3_calls_queued, key="limits.max_l3_calls_queued"),
            hash=Lane("hash", s.hash_threads),
            bookkeeping=Lane("bookkeeping", s.bookkeeping_threads),
        )

    def shutdown(self) -> None:
        for lane in (self.copy, self.l3, self.hash, self.bookkeeping):
            lane.shutdown()
