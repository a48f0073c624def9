"""What the blocking client does differently from the asyncio one, written by hand.

The twin of ``_aio_backend.py`` (see there): the same names without ``Async``, used by the
generated ``sync.py`` and ``_sync_session.py``.

Thread-safety: every function and :class:`Beat` may be used from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from hicached_client._handoff import hand_over

# Guards a session's closed flag and its lazily opened fast lane.
Lock = threading.Lock
# What a grpc channel raises, instead of an RpcError, for a call it does not start (ValueError
# on a closed channel); the twin of ``_aio_backend.START_ERRORS``.
START_ERRORS: tuple[type[Exception], ...] = (ValueError,)
CLOSED_ERRORS: tuple[type[Exception], ...] = (ValueError,)
# A blocking call whose channel closes under it fails with CANCELLED (an RpcError): no
# exception of its own (the twin of ``_aio_backend.CANCELLED_ERRORS``).
CANCELLED_ERRORS: tuple[type[BaseException], ...] = ()


def cancelled_by_close() -> bool:
    return True


def close_channel(channel: grpc.Channel) -> None:
    channel.close()


def pause(seconds: float) -> None:
    """Let ``seconds`` pass (the twin of ``_aio_backend.pause``)."""
    time.sleep(seconds)


def channel_ready(channel: grpc.Channel, timeout_s: float) -> bool:
    """True once the channel connects, False after ``timeout_s``."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        return False
    return True


def next_message(rpc: Any) -> Any | None:
    """The next message of a server stream, None at its end (``grpc.RpcError`` on failure)."""
    return next(rpc, None)


class Beat:
    """Calls ``body()`` every ``interval_s`` on a daemon thread until it returns False or :meth:`stop`."""

    def __init__(self, body: Callable[[], bool], interval_s: float, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(body, interval_s), name=name, daemon=True)
        self._thread.start()

    def _run(self, body: Callable[[], bool], interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if not body():
                return

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop beating and wait for the thread to end (a no-op from the beat itself)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


__all__ = [
    "CLOSED_ERRORS",
    "START_ERRORS",
    "Beat",
    "Lock",
    "channel_ready",
    "close_channel",
    "hand_over",
    "next_message",
]
