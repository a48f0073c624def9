"""Separate, bounded thread pools ("lanes") for the kinds of blocking work an RPC does.

The event loop only parses, authorizes and schedules; anything that blocks or is
proportional to a request's size runs on a lane. Each kind has its own threads,
so a hung L3 that holds every L3 thread cannot delay an attach, a heartbeat, the
lease reaper or GetStats (bookkeeping), nor a copy:

* ``copy``: RPCs that wait for the copy engine (Write, Load, PutPages, ...), at
  most ``limits.max_copy_calls_per_session`` of one session in it (the engine
  serves sessions fairly, but only the calls that reached it);
* ``l3``: RPCs that wait for the L3 backend (include_l3, Backup, Prefetch, ...),
  with at most ``limits.max_l3_calls_queued`` waiting beyond its threads and at
  most ``limits.max_l3_calls_per_session`` of one session in it (then
  RESOURCE_EXHAUSTED naming the key, before any work);
* ``hash``: token-chain hashing and key checks (CPU-bound), bounded as the l3 lane
  (``limits.max_hash_calls_queued``, ``limits.max_hash_calls_per_session``): each call
  holds its request, up to ``server.max_message_bytes``;
* ``bookkeeping``: attach, stats, the lease reaper;
* ``alloc``: an Alloc or ResolveTransfers that may zero more than a MiB of reused host pages,
  at most ``limits.max_alloc_calls_per_session`` of one session.

:data:`RPC_LANES` is the one table of where each RPC's core call runs: on the event
loop (O(1) work, or page bookkeeping, whose thread hop would cost more than the
call) or on which lane; servicers only say ``offload("Name", fn, ...)``
(``rpc_base.ServicerBase.offload``), and tests check the table names every RPC.

Thread-safety: :meth:`Lane.run` is called on the event loop only (its counter is
loop-confined); the pools themselves are thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, TypeVar

from hicached.config import Config
from hicached.errors import LimitExceeded

T = TypeVar("T")

__all__ = ["RPC_LANES", "Lane", "Lanes", "Where"]


class Lane:
    """One bounded pool; ``max_queued`` (None = unbounded) calls may wait beyond its threads,
    and one session may have at most ``per_session`` (None = any number) in it at once."""

    def __init__(
        self,
        name: str,
        threads: int,
        *,
        max_queued: int | None = None,
        key: str = "",
        per_session: int | None = None,
        per_session_key: str = "",
    ) -> None:
        self.name = name
        self.threads = threads
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"hicached-{name}")
        self._max_queued = max_queued
        self._key = key
        self._per_session = per_session
        self._per_session_key = per_session_key
        self.pending = 0  # calls whose work has not ended (event-loop confined)
        self._held: dict[str, int] = {}  # the same, per session (event-loop confined)

    async def run(self, fn: Callable[..., T], *args: Any, session: str = "", **kwargs: Any) -> T:
        """Run ``fn`` on the lane's threads; ``session`` (authenticated) is the caller's id.
        Event loop only. ``fn``'s error is raised as is; the lane keeps no reference to it
        (nor to the work), so what its frames hold goes with the error."""
        held = self._held.get(session, 0) if session else 0
        if session and self._per_session is not None and held >= self._per_session:
            # One session's blocking calls (waits of up to limits.max_wait_s) must leave
            # threads for the others.
            raise LimitExceeded(
                f"this session already has {held} calls on the {self.name} lane, the most "
                f"{self._per_session_key}={self._per_session} allows: wait for one to finish",
                self._per_session_key,
            )
        if self._max_queued is not None and self.pending >= self.threads + self._max_queued:
            raise LimitExceeded(
                f"{self.pending} calls already wait for the {self.name} lane ({self.threads} threads, "
                f"{self._key}={self._max_queued} may queue): retry later",
                self._key,
            )
        self.pending += 1
        if session:
            self._held[session] = held + 1
        loop = asyncio.get_running_loop()
        work = self.executor.submit(functools.partial(fn, *args, **kwargs))

        def finished(_: object) -> None:  # on the lane's thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to count
                loop.call_soon_threadsafe(self._finished, session)

        try:
            return await asyncio.wrap_future(work, loop=loop)
        finally:
            # The place is given back when the work ends, not when its caller stops waiting:
            # a cancelled call (the client's deadline) keeps its thread until then. One still
            # queued was cancelled with its caller and has ended.
            if work.done():
                self._finished(session)
            else:
                work.add_done_callback(finished)
            # The work's error is raised here (or, when this call was cancelled, kept by the
            # work): this frame in its traceback must not hold the work, which holds the error.
            # Else the cycle keeps the failed call's frames -- a session's device views among
            # them -- until the cyclic collector runs, whoever still waits for the call.
            del work

    def _finished(self, session: str) -> None:
        self.pending -= 1
        if session:
            left = self._held[session] - 1
            if left:
                self._held[session] = left
            else:
                del self._held[session]

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class Where(Enum):
    """Where an RPC's core call runs."""

    LOOP = "loop"  # O(1) work: the event loop itself
    COPY = "copy"  # waits for the copy engine
    L3 = "l3"  # may wait for the L3 backend
    BOOKKEEPING = "bookkeeping"  # attach and stats: never behind copies or L3
    # Page bookkeeping (alloc/free/resolve/release): microseconds of work, so the event
    # loop (the thread hop would cost more, ~200 us here). An allocation never waits for L3:
    # under write_back it evicts only pages L3 holds (hicached.index.writer.Writer.reclaim).
    # One that may zero more than a MiB of reused pages runs on the alloc lane instead
    # (hicached.server.rpc_pages.INLINE_ALLOC_BYTES).
    PAGES = "pages"
    ALLOC = "alloc"  # a large allocation: zeroing reused pages, behind no other kind of work
    COPY_OR_L3 = "copy_or_l3"  # the copy lane; the L3 lane when the call reaches L3


RPC_LANES: Mapping[str, Where] = MappingProxyType(
    {
        # HiCacheService: sessions
        "Attach": Where.BOOKKEEPING,
        "Detach": Where.COPY,  # waits for the session's copies to finish
        "Heartbeat": Where.LOOP,
        # host pages
        "Alloc": Where.PAGES,
        "Free": Where.PAGES,
        "ResolveTransfers": Where.PAGES,
        "ReleaseTransfers": Where.PAGES,
        # data plane and retraction
        "Write": Where.COPY,
        "Load": Where.COPY,
        "RetractBackup": Where.COPY,
        "RetractRestore": Where.COPY,
        "RetractDiscard": Where.PAGES,
        # content-addressed (a KeySource is hashed and checked on the hash lane first)
        "Lookup": Where.COPY_OR_L3,  # L3 when a backend is configured (it asks L3 for what L2 lacks)
        "Publish": Where.COPY,
        "PutPages": Where.COPY,
        "GetPages": Where.COPY_OR_L3,  # L3 with include_l3
        "Prefetch": Where.L3,
        "PrefetchStatus": Where.L3,
        "CancelPrefetch": Where.L3,
        "Backup": Where.L3,
        "PutBytes": Where.COPY,
        "GetBytes": Where.COPY_OR_L3,  # L3 with include_l3
        # observability
        "GetStats": Where.BOOKKEEPING,
        "Ping": Where.LOOP,
        # AdminService
        "Drain": Where.L3,  # flushes the write-back queue
        "Resume": Where.LOOP,
        "ClearNamespace": Where.L3,
    }
)


# Zeroing is bound by memory bandwidth, which two threads on most nodes take whole.
ALLOC_THREADS = 2


@dataclass(frozen=True)
class Lanes:
    copy: Lane
    l3: Lane
    hash: Lane
    bookkeeping: Lane
    alloc: Lane

    @classmethod
    def from_config(cls, config: Config) -> Lanes:
        s, lim = config.server, config.limits
        return cls(
            copy=Lane(
                "copy",
                s.copy_threads,
                per_session=lim.max_copy_calls_per_session,
                per_session_key="limits.max_copy_calls_per_session",
            ),
            l3=Lane(
                "l3",
                s.l3_threads,
                max_queued=lim.max_l3_calls_queued,
                key="limits.max_l3_calls_queued",
                per_session=lim.max_l3_calls_per_session,
                per_session_key="limits.max_l3_calls_per_session",
            ),
            hash=Lane(
                "hash",
                s.hash_threads,
                max_queued=lim.max_hash_calls_queued,
                key="limits.max_hash_calls_queued",
                per_session=lim.max_hash_calls_per_session,
                per_session_key="limits.max_hash_calls_per_session",
            ),
            bookkeeping=Lane("bookkeeping", s.bookkeeping_threads),
            # Busy allocations of some sessions delay only other sessions' large allocations;
            # the per-session limit bounds what one session's queued requests hold.
            alloc=Lane(
                "alloc",
                ALLOC_THREADS,
                per_session=lim.max_alloc_calls_per_session,
                per_session_key="limits.max_alloc_calls_per_session",
            ),
        )

    def lane_for(self, where: Where, *, l3: bool) -> Lane | None:
        """The lane of a placement (None: the event loop). ``l3``: this call reaches L3
        (COPY_OR_L3)."""
        if where is Where.COPY_OR_L3:
            return self.l3 if l3 else self.copy
        lanes = {
            Where.COPY: self.copy,
            Where.L3: self.l3,
            Where.BOOKKEEPING: self.bookkeeping,
            Where.ALLOC: self.alloc,
        }
        return lanes.get(where)

    def shutdown(self) -> None:
        for lane in (self.copy, self.l3, self.hash, self.bookkeeping, self.alloc):
            lane.shutdown()
