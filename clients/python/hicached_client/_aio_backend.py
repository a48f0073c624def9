"""What the asyncio client does differently from the blocking one, written by hand.

``tools/unasync.py`` generates the blocking client (``sync.py``, ``_sync_session.py``) from
the asyncio one (``aio.py``, ``_aio_session.py``) by renaming (``async def`` -> ``def``,
``AsyncBeat`` -> ``Beat``, ``_aio_backend`` -> ``_sync_backend``, ...). What a rename cannot
express lives here and, under the same names without ``Async``, in ``_sync_backend.py``.

Thread-safety: everything here belongs to the event loop that created it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc.aio import EOF  # type: ignore[attr-defined]

from hicached_client import _handoff

log = logging.getLogger(__name__)

# Guards a session's closed flag and its lazily opened fast lane.
AsyncLock = asyncio.Lock
# What grpc.aio raises, instead of an RpcError, for a call it does not start: UsageError on a
# closed channel, ExecuteBatchError (an InternalError) for metadata it cannot send.
START_ERRORS: tuple[type[Exception], ...] = (grpc.aio.BaseError,)
CLOSED_ERRORS: tuple[type[Exception], ...] = (grpc.aio.UsageError,)
# What a call under way raises when the client's close() closes its channel: grpc.aio cancels
# the call's await. Told from a cancel of the caller's own task by ``cancelled_by_close``.
CANCELLED_ERRORS: tuple[type[BaseException], ...] = (asyncio.CancelledError,)


def cancelled_by_close() -> bool:
    """Whether the CancelledError being handled came from the channel closing under the call,
    not from a cancel of the running task (which must go on as a cancel)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


async def close_channel(channel: grpc.aio.Channel) -> None:
    await channel.close(grace=None)


async def pause(seconds: float) -> None:
    """Let ``seconds`` pass (the loop runs other tasks meanwhile)."""
    await asyncio.sleep(seconds)


async def channel_ready(channel: grpc.aio.Channel, timeout_s: float) -> bool:
    """True once the channel connects, False after ``timeout_s``."""
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except TimeoutError:
        return False
    return True


async def hand_over(path: str, fds: Sequence[int], timeout_s: float | None) -> str | None:
    """:func:`hicached_client._handoff.hand_over` on a thread (one blocking round trip)."""
    return await asyncio.to_thread(_handoff.hand_over, path, fds, timeout_s)


async def next_message(rpc: Any) -> Any | None:
    """The next message of a server stream, None at its end (``grpc.RpcError`` on failure)."""
    message = await rpc.read()
    return None if message is EOF else message


class AsyncBeat:
    """Awaits ``body()`` every ``interval_s`` on a task of the running loop until it returns False."""

    def __init__(self, body: Callable[[], Awaitable[bool]], interval_s: float, name: str) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(body, interval_s), name=name)

    @staticmethod
    async def _run(body: Callable[[], Awaitable[bool]], interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)  # the period itself, not synchronisation
            if not await body():
                return

    @property
    def running(self) -> bool:
        return not self._task.done()

    async def stop(self) -> None:
        """Stop beating and wait for the task to end (a no-op from the beat itself).

        Never raises what the task died of (logged instead): stopping is part of every close,
        which must go on to detach and close the channel.
        """
        if self._task is asyncio.current_task():
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await self._task
            except Exception:
                log.exception("heartbeat task %s had failed", self._task.get_name())
