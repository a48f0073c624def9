"""The interceptor that counts each call's request against its peer until the call ends
(``limits.max_request_bytes_held_per_peer``, :class:`hicached.server.peers.HeldRequests`).

It runs innermost, after the session checks: a request that names a session counts against
the peer that attached it (its handoff uid, its TCP host, or the socket), any other against
the peer the transport names. A refusal is RESOURCE_EXHAUSTED with a retry hint, before the
handler runs: nothing changes.

Thread-safety: loop-confined, as :class:`~hicached.server.peers.HeldRequests` is.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

from hicached.core.service import HiCacheCore
from hicached.errors import HiCacheError
from hicached.server.interceptors import CallInterceptor, Ctx
from hicached.server.peers import HeldRequests, peer_key

__all__ = ["HeldRequestsInterceptor"]


class _Held:
    __slots__ = ("held", "key", "method", "nbytes")

    def __init__(self, held: HeldRequests, key: str, nbytes: int, method: str) -> None:
        self.held = held
        self.key = key
        self.nbytes = nbytes
        self.method = method

    async def __aenter__(self) -> None:
        self.held.hold(self.key, self.nbytes, self.method)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:  # fmt: skip
        self.held.release(self.key, self.nbytes)
        return False


class HeldRequestsInterceptor(CallInterceptor):
    """Holds each call's request size (``ByteSize``: the wire bytes, computed in C) for its
    peer while the handler runs."""

    def __init__(
        self, core: HiCacheCore, held: HeldRequests, services: Collection[str] | None = None
    ) -> None:
        super().__init__(services)
        self._core = core
        self._held = held

    def around(self, method: str, request: Any, context: Ctx) -> AbstractAsyncContextManager[None]:
        return _Held(self._held, self._peer(request, context), request.ByteSize(), method)

    def _peer(self, request: Any, context: Ctx) -> str:
        session_id = getattr(request, "session_id", "")
        if session_id:
            try:
                return self._core.session_origin(session_id) or "unix"
            except HiCacheError:  # unknown: the handler answers NOT_FOUND
                pass
        return peer_key(None, context.peer() or "")
