"""The asyncio face of the fast lane: the same ring, waited on with ``loop.add_reader``.

``await AsyncFastLane.open(session)`` (an ``AsyncSession`` or ``Session``) negotiates on a
thread (one blocking round trip), then every op submits its record and awaits the
completion doorbell on the event loop: nothing blocks the loop. Results and errors are the
session's (``WriteResult``, ``LoadResult``, ``ResolveResult``, ``GetPagesResult``,
``PutPagesResult``, ``HiCacheError``). What it shares with the blocking lane (the request
record, the doorbell, errors, results) is in ``_lane_common.py``; it uses the blocking lane
only through its public methods (``submit_raw``, ``published``, ``completion``, ``wake_fds``).

Thread-safety: use one AsyncFastLane from one event loop; its ops are serialised by an
``asyncio.Lock``. :meth:`close` is idempotent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Self

from hicached_client import _lane_common as lc
from hicached_client import lane_wire as w
from hicached_client.fastlane import FastLane
from hicached_client.types import (
    GetPagesResult,
    LoadResult,
    LookupResult,
    PutPagesResult,
    ResolveResult,
    Transfer,
    WriteResult,
)

# What :meth:`AsyncFastLane.close` wakes an op's wait with (no descriptor's number).
_CLOSING = -1


class AsyncFastLane:
    """One open lane of one session, for asyncio callers."""

    def __init__(self, lane: FastLane) -> None:
        self.lane = lane
        self._lock = asyncio.Lock()
        self._woke: asyncio.Future[int] | None = None  # the wait of the op under way, if any
        self._closing = False  # set by close(): an op not yet waiting fails before it waits

    @classmethod
    async def open(cls, session: Any, *, timeout_s: float = 5.0) -> AsyncFastLane:
        lane = await asyncio.to_thread(FastLane.open, session, timeout_s=timeout_s)
        return cls(lane)

    async def close(self, *, timeout_s: float = 5.0) -> None:
        """As :meth:`FastLane.close`. An op waiting for its completion is woken and fails UNAVAILABLE
        first, so no op touches the lane's descriptors once they are closed (their numbers
        may be another file's by then)."""
        self._closing = True  # one loop: an op either sees this before it waits, or is woken
        if self._woke is not None and not self._woke.done():
            self._woke.set_result(_CLOSING)
        async with self._lock:
            await asyncio.to_thread(self.lane.close, timeout_s=timeout_s)

    @property
    def closed(self) -> bool:
        return self.lane.closed

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def write(
        self,
        transfers: Sequence[Transfer],
        *,
        allocate: bool = False,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> WriteResult:
        flags = w.FLAG_ALLOCATE if allocate else 0
        return lc.write_result(await self._call(w.Opcode.WRITE, flags, transfers, op_id, timeout_s))

    async def load(
        self,
        transfers: Sequence[Transfer],
        *,
        layer_progress: bool = True,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LoadResult:
        flags = w.FLAG_LAYER_PROGRESS if layer_progress else 0
        return lc.load_result(await self._call(w.Opcode.LOAD, flags, transfers, op_id, timeout_s))

    async def resolve_transfers(
        self, transfers: Sequence[Transfer], *, op_id: str | None = None, timeout_s: float | None = None
    ) -> ResolveResult:
        return lc.resolve_result(await self._call(w.Opcode.RESOLVE, 0, transfers, op_id, timeout_s))

    async def release_transfers(
        self, transfers: Sequence[Transfer], *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        return (await self._call(w.Opcode.RELEASE, 0, transfers, op_id, timeout_s)).value

    async def lookup(self, keys: Sequence[str], *, timeout_s: float | None = None) -> LookupResult:
        return lc.lookup_result(await self._call(w.Opcode.LOOKUP, 0, (), None, timeout_s, keys), keys)

    async def get_pages(
        self,
        keys: Sequence[str],
        transfers: Sequence[Transfer],
        *,
        include_l3: bool = False,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> GetPagesResult:
        flags = w.FLAG_INCLUDE_L3 if include_l3 else 0
        return lc.get_pages_result(
            await self._call(w.Opcode.GET_PAGES, flags, transfers, op_id, timeout_s, keys)
        )

    async def put_pages(
        self,
        keys: Sequence[str],
        transfers: Sequence[Transfer],
        *,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PutPagesResult:
        c = await self._call(w.Opcode.PUT_PAGES, 0, transfers, op_id, timeout_s, keys)
        return lc.put_pages_result(c, len(keys))

    async def ping(self, *, timeout_s: float | None = None) -> None:
        await self._call(w.Opcode.PING, 0, (), None, timeout_s)

    async def _call(
        self,
        opcode: w.Opcode,
        flags: int,
        transfers: Sequence[Transfer],
        op_id: str | None,
        timeout_s: float | None,
        keys: Sequence[str] = (),
    ) -> w.Completion:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        try:  # another task's op may hold the lane: that wait counts against this op's timeout
            await asyncio.wait_for(self._lock.acquire(), timeout_s)
        except TimeoutError:
            raise lc.timed_out() from None  # nothing sent: the op can be sent again
        try:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left < lc.MIN_SEND_S:
                raise lc.timed_out()  # nothing sent (the lane stays open): the op can be sent again
            seq = self.lane.submit_raw(lc.request(opcode, flags, transfers, op_id, keys))
            try:
                await asyncio.wait_for(self._ready(seq), left)
            except TimeoutError:
                self.lane.abandon()
                raise lc.timed_out() from None
            except asyncio.CancelledError:
                self.lane.abandon()  # the caller gave up on the op: the daemon must not run it later
                raise
            return self.lane.completion(seq)  # published: reads without waiting
        finally:
            self._lock.release()

    async def _ready(self, seq: int) -> None:
        """Until the completion of ``seq`` is published (UNAVAILABLE if the daemon closes the lane)."""
        lane = self.lane
        loop = asyncio.get_running_loop()
        done_fd, conn_fd = lane.wake_fds
        while not lane.published(seq):
            woke: asyncio.Future[int] = loop.create_future()

            def wake(fd: int, woke: asyncio.Future[int] = woke) -> None:
                if not woke.done():
                    woke.set_result(fd)

            loop.add_reader(done_fd, wake, done_fd)
            loop.add_reader(conn_fd, wake, conn_fd)
            self._woke = woke
            if self._closing:
                woke.set_result(_CLOSING)
            try:
                fd = await woke
            finally:
                self._woke = None
                loop.remove_reader(done_fd)
                loop.remove_reader(conn_fd)
            if fd == _CLOSING:
                lane.abandon()  # the op's answer will not be read: the daemon must not run it later
                raise lc.unavailable("the fast lane is closed")
            if fd == done_fd:
                lc.drain(done_fd)
            elif not lane.published(seq):
                lane.close()
                raise lc.closed_by_daemon()


__all__ = ["AsyncFastLane"]
