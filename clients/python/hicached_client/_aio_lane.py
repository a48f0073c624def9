"""A session's fast lane: :class:`AsyncLaneSlot` opens it on first use and drops it when lost.

``_aio_lane.py`` is written by hand and ``_sync_lane.py`` generated from it (see ``aio.py``).
The session asks the slot for the lane before each hot operation; ``None`` means gRPC (the
client did not ask for the lane, the daemon has none or refused it, it was lost, or the
session ended). Once off, the slot stays off: a lane is opened at most once per session.

Thread-safety: the blocking slot guards its state with a lock (opening happens under it, so
two threads never open two lanes); the asyncio slot belongs to its session's event loop.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from hicached_client._aio_backend import AsyncLock
from hicached_client._channel import RetryPolicy
from hicached_client._lane_common import lane_carries
from hicached_client.errors import HiCacheError
from hicached_client.fastlane_aio import AsyncFastLane
from hicached_client.types import Keys, TokenChain

log = logging.getLogger(__name__)


def lane_keys(keys: Keys, tenant: str) -> list[str] | None:
    """The keys as the lane carries them (given keys, the session's tenant), else None: gRPC."""
    if tenant or isinstance(keys, (TokenChain, str, bytes)):
        return None
    return list(keys)


class AsyncLaneSlot:
    """The fast lane of one session, or why there is none (see the module docstring)."""

    def __init__(self, enabled: bool) -> None:
        self._lock = AsyncLock()
        self._lane: AsyncFastLane | None = None
        self._off = not enabled  # not asked for, refused, lost or closed

    async def get(self, session: Any, fits: bool, op_id: str = "") -> AsyncFastLane | None:
        """The lane for a call of ``session``; None: send it over gRPC.

        ``fits``: the call uses nothing the lane lacks (primary pages, a ready fence);
        ``op_id``: the call's, which a lane record must carry (:func:`lane_carries`).
        """
        if not fits or self._off or not lane_carries(op_id):
            return None
        async with self._lock:
            if self._lane is None and not self._off:
                try:
                    self._lane = await AsyncFastLane.open(session)
                except HiCacheError as exc:
                    log.info("session %s: no fast lane, using gRPC: %s", session.session_id, exc)
                    self._off = True
            return self._lane

    async def failed(self, error: HiCacheError, rpc: str, retry: RetryPolicy) -> None:
        """After a lane op failed: return to re-send it over gRPC (same op_id), else raise.

        UNAVAILABLE means the lane is gone (the daemon closed it, or the op could not be
        sent): the slot drops it and the caller re-sends the op over gRPC with the same
        op_id, so an op the daemon already ran is answered, not run again. Backpressure
        (RESOURCE_EXHAUSTED) that ``retry`` retries goes to gRPC too, whose channel retries
        it after the daemon's hint. Any other status is the op's own answer, raised as the
        gRPC call raises it (named for its RPC); a lane that timed out on the op closed
        itself (see ``FastLane.abandon``), so the slot drops it and later ops go over gRPC.
        """
        if error.code == grpc.StatusCode.DEADLINE_EXCEEDED and self._lane is not None and self._lane.closed:
            log.warning("fast lane op timed out (%s); the lane is closed, later ops go over gRPC", rpc)
            await self.close()
        elif error.code == grpc.StatusCode.UNAVAILABLE:
            log.warning("fast lane lost (%s); %s goes over gRPC", error, rpc)
            await self.close()
            return
        if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry.retries(error.code):
            return
        raise HiCacheError(
            error.code, error.message, retry_after_ms=error.retry_after_ms, method=rpc
        ) from None

    async def close(self) -> None:
        """Close the lane (if open) and stay off. Idempotent."""
        async with self._lock:
            lane, self._lane, self._off = self._lane, None, True
        if lane is not None:
            await lane.close()
