"""A stream cancelled while the client starts its retry does not go on (found by a review of
the client-side stream retry): the blocking client's ``cancel()`` from another thread went to
the failed try, the new try ran on (the daemon loading into device pages the worker had given
up) and the cancelled stream returned its message. The race is driven here with stand-in RPC
objects, the one way to place a cancel between a try's start and its first read."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from hicached_client import HiCacheError, sync
from hicached_client._channel import RetryPolicy


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset"

    def trailing_metadata(self) -> Any:
        return ()


class _Rpc:
    """A started try: the first fails UNAVAILABLE, a later one answers its final message."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.cancelled = False

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        if self.fails:
            raise _Unavailable()
        return SimpleNamespace(done=True, layer=-1)

    def cancel(self) -> None:
        self.cancelled = True


def test_a_cancel_while_the_retry_starts_cancels_the_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync.backend, "pause", lambda seconds: None)
    tries: list[_Rpc] = []
    streams: list[sync.LoadStream] = []

    def start_stream(call: Any, timeout_s: float | None) -> _Rpc:
        if tries:  # the retry: the worker's other thread cancels while it starts
            canceller = threading.Thread(target=streams[0].cancel)
            canceller.start()
            canceller.join(10)
        tries.append(_Rpc(fails=not tries))
        return tries[-1]

    client = SimpleNamespace(
        config=SimpleNamespace(retry=RetryPolicy()),
        _start_stream=start_stream,
        _closed_under=lambda method: None,
    )
    streams.append(sync.LoadStream(client, SimpleNamespace(method="Load", convert=lambda m: m), 5.0))  # type: ignore[arg-type]
    with pytest.raises(HiCacheError) as info:
        next(streams[0])
    assert info.value.code == grpc.StatusCode.CANCELLED
    assert [t.cancelled for t in tries] == [True, True]  # before: the retry's try ran on
    with pytest.raises(StopIteration):
        next(streams[0])
