"""The interceptor that counts each call's request against its peer until the call ends
(``limits.max_request_bytes_held_per_peer``, :class:`hicached.server.peers.HeldRequests`).

It runs innermost, after the session checks. Only requests that name a session count, against
the peer that attached it (its handoff uid, its TCP host, or the socket), and only those of
at least :data:`COUNTED_BYTES`: heartbeats, detaches and other small calls always pass (a
peer at its bound must keep its leases), and a session-less call (Attach, GetStats, Ping)
names no peer but the transport's, which every ticketless client on the socket shares (one
client could refuse the others' attaches); an attach is bounded by ``limits.max_request_bytes``
and ``limits.max_sessions_per_peer``. A refusal is RESOURCE_EXHAUSTED with a retry hint,
before the handler runs: nothing changes.

The size is the request's on the wire, as the deserializer received it: gRPC parses a
request in the call's own task, so a context variable set there is the handler's
(``ByteSize`` would serialize the request again on the event loop: ~0.2 s for 64 MiB).

Thread-safety: loop-confined, as :class:`~hicached.server.peers.HeldRequests` is.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Collection
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

from hicached.core.service import HiCacheCore
from hicached.errors import HiCacheError
from hicached.server.interceptors import CallInterceptor, Ctx
from hicached.server.peers import HeldRequests

__all__ = ["COUNTED_BYTES", "HeldRequestsInterceptor"]

# Requests smaller than this are not counted (see the module docstring).
COUNTED_BYTES = 64 << 10

# The wire size of the request the current call's deserializer parsed last.
_WIRE_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("hicached_wire_bytes", default=-1)


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
    """Holds each counted call's request size for its peer while the handler runs."""

    def __init__(
        self, core: HiCacheCore, held: HeldRequests, services: Collection[str] | None = None
    ) -> None:
        super().__init__(services)
        self._core = core
        self._held = held

    def deserializer(
        self, inner: Callable[[bytes], Any] | None, method: str
    ) -> Callable[[bytes], Any] | None:
        if inner is None:
            return None

        def parse(raw: bytes) -> Any:
            _WIRE_BYTES.set(len(raw))
            return inner(raw)

        return parse

    def around(self, method: str, request: Any, context: Ctx) -> AbstractAsyncContextManager[None]:
        nbytes = _WIRE_BYTES.get()
        if nbytes < 0:  # no parse seen in this context (never in gRPC's servers): count it anyway
            nbytes = request.ByteSize()
        session_id = getattr(request, "session_id", "")
        if nbytes < COUNTED_BYTES or not session_id:
            return contextlib.nullcontext()
        try:
            key = self._core.session_origin(session_id) or "unix"
        except HiCacheError:  # unknown: the handler answers NOT_FOUND
            return contextlib.nullcontext()
        return _Held(self._held, key, nbytes, method)
