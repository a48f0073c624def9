"""What every daemon RPC goes through, as gRPC server interceptors.

A servicer method only converts messages and calls the core; around it, in this
order from the outside in (``app.Server`` builds the chain per listener):

1. :class:`TokenInterceptor` (TCP only): a call without a configured bearer token
   is refused UNAUTHENTICATED before anything is decoded (health stays open);
2. ``decode.DecodeInterceptor``: undecodable bytes are INVALID_ARGUMENT;
3. :class:`ErrorInterceptor`: a daemon error becomes its answer
   (:func:`hicached.server.status.answer_for`, the fast lane's too): its status code, its
   retry hint (``grpc-retry-pushback-ms``) and a message cut at ``MAX_MESSAGE_CHARS``;
   anything else is a bug, logged and answered INTERNAL;
4. :class:`MetricsInterceptor`: the per-RPC observation (method, code, seconds);
5. :class:`SessionInterceptor`: identifiers within ``limits.max_identity_bytes``, and
   a request naming a ``session_id`` carries that session's secret;
6. ``held.HeldRequestsInterceptor``: the request counts against its peer until the call
   ends (``limits.max_request_bytes_held_per_peer``).

Every per-call concern is a :class:`CallInterceptor`: it wraps each unary-request
method of its services once, so unary and server-streaming calls take one path
(``around`` is entered before the handler and exited after its reply, or after the
last message of a stream). Thread-safety: the interceptors are stateless apart from
their per-method handler caches, which only the event loop touches.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from hicached.config import LimitsConfig
from hicached.core.service import HiCacheCore
from hicached.errors import Unauthenticated
from hicached.server.limits import check_ids
from hicached.server.observer import RpcObserver
from hicached.server.roles import HEALTH_PREFIX, Access
from hicached.server.status import MAX_MESSAGE_CHARS, answer_for, status_for, trailing_metadata_for

__all__ = [
    "MAX_MESSAGE_CHARS",
    "SESSION_SECRET_METADATA",
    "CallInterceptor",
    "ErrorInterceptor",
    "MetricsInterceptor",
    "SessionInterceptor",
    "TokenInterceptor",
]

logger = logging.getLogger(__name__)
Ctx = grpc.aio.ServicerContext[Any, Any]
if TYPE_CHECKING:  # grpc's handler type is generic only in its stubs
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable[Handler]]
# Metadata key of the session capability (AttachResponse.session_secret).
SESSION_SECRET_METADATA = "x-hicached-session-secret"


class CallInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Runs :meth:`around` around every call of the unary-request methods of ``services``
    (full service names; every service when None). A subclass may also replace the
    request deserializer (:meth:`deserializer`)."""

    def __init__(self, services: Collection[str] | None = None) -> None:
        self._prefixes = None if services is None else tuple(f"/{s}/" for s in services)
        self._cache: dict[str, Handler | None] = {}

    def around(self, method: str, request: Any, context: Ctx) -> AbstractAsyncContextManager[None]:
        """The per-call context: entered before the handler, exited after it."""
        raise NotImplementedError

    def deserializer(
        self, inner: Callable[[bytes], Any] | None, method: str
    ) -> Callable[[bytes], Any] | None:
        """The request deserializer of ``method`` (its name, e.g. ``Write``)."""
        return inner

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> Handler:
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or handler.request_streaming:
            return handler
        if self._prefixes is not None and not method.startswith(self._prefixes):
            return handler
        if method not in self._cache:
            self._cache[method] = self._wrap(handler, method.rpartition("/")[2])
        return self._cache[method] or handler

    def _wrap(self, handler: Handler, name: str) -> Handler | None:
        """The handler with :meth:`around` and the deserializer; None (leave it) for a sync one."""
        around = self.around
        kw = {
            "request_deserializer": self.deserializer(handler.request_deserializer, name),
            "response_serializer": handler.response_serializer,
        }
        inner = handler.unary_unary
        if inner is not None and inspect.iscoroutinefunction(inner):

            async def unary(request: Any, context: Any) -> Any:
                async with around(name, request, context):
                    return await inner(request, context)
                return None  # the context swallowed an error: it already answered the call

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        stream = handler.unary_stream
        if stream is not None and inspect.isasyncgenfunction(stream):

            async def replies(request: Any, context: Any) -> AsyncIterator[Any]:
                async with around(name, request, context):
                    async for reply in stream(request, context):
                        yield reply

            return grpc.unary_stream_rpc_method_handler(replies, **kw)
        if stream is not None and inspect.iscoroutinefunction(stream):  # writes with context.write

            async def writer(request: Any, context: Any) -> None:
                async with around(name, request, context):
                    await stream(request, context)

            return grpc.unary_stream_rpc_method_handler(writer, **kw)
        return None


class _Mapped:
    """A daemon error -> its status (see :func:`answer_error`); a bug -> INTERNAL."""

    __slots__ = ("context", "method")

    def __init__(self, method: str, context: Ctx) -> None:
        self.method = method
        self.context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:  # fmt: skip
        # This frame outlives the call: the AbortError that answer_error raises keeps it in its
        # traceback, and gRPC keeps that error. It must not keep ``exc``'s frames too.
        del tb
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, grpc.aio.AbortError):
            return False  # success, cancellation, a stream's close, or an answer already given
        await answer_error(self.context, self.method, exc)
        return True  # nobody is left to answer (the client went away)


class ErrorInterceptor(CallInterceptor):
    """Errors to status codes, one path for every RPC of ``services``."""

    def around(self, method: str, request: Any, context: Ctx) -> AbstractAsyncContextManager[None]:
        return _Mapped(method, context)


async def answer_error(context: Ctx, method: str, exc: Exception) -> None:
    """Abort the call with ``exc``'s answer (:func:`hicached.server.status.answer_for`: status,
    message, retry hint; raises AbortError), or return when the client is gone. A bug is logged
    and answered INTERNAL."""
    answer = answer_for(exc, method)
    if answer.log_it:  # a bug stays a bug, whoever is listening
        logger.exception("internal error in %s", method, exc_info=exc)
    if context.cancelled() or context.done():
        # The client went away (it stopped reading a stream, or cancelled): nobody is left
        # to answer, and that is the client's choice, not a daemon error.
        if not answer.log_it:
            logger.debug("%s ended by the client: %s: %s", method, type(exc).__name__, exc)
        _forget_frames(exc)
        return
    _forget_frames(exc)  # before abort: its AbortError takes ``exc`` as its __context__
    context.set_trailing_metadata(trailing_metadata_for(exc))
    await context.abort(answer.code, answer.message)


def _forget_frames(exc: BaseException) -> None:
    """Drop the frames of ``exc`` and of the errors it chains (``__cause__``, ``__context__``),
    once it is logged: what they hold is released now, by reference counting, not at the next
    cyclic garbage collection.

    Why: the failed call's frames hold what it had opened -- the session of a cancelled copy
    (through the closure the core ran it in), a partly mapped attach's tensors -- and the
    error outlives the call in reference cycles: gRPC keeps an aborted call's AbortError,
    whose ``__context__`` is ``exc`` and whose frames hold the call's context, which holds
    that AbortError. Clearing the frames' locals is not enough: a cleared frame still holds
    its function (a closure's cells) and its caller's frame. Event-loop only: ``exc`` is not
    being raised elsewhere (the worker thread that raised it has returned).
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)  # the locals of frames still held elsewhere
        err.__traceback__ = None
        todo += (err.__cause__, err.__context__)


class _Timed:
    """One observation per call: OK, CANCELLED, or the code its error maps to."""

    __slots__ = ("method", "observe", "start")

    def __init__(self, method: str, observe: RpcObserver) -> None:
        self.method = method
        self.observe = observe
        self.start = 0.0

    async def __aenter__(self) -> None:
        self.start = time.perf_counter()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:  # fmt: skip
        code = grpc.StatusCode.OK
        if isinstance(exc, asyncio.CancelledError):
            code = grpc.StatusCode.CANCELLED
        elif isinstance(exc, Exception):
            code = status_for(exc) or grpc.StatusCode.INTERNAL
        self.observe.on_rpc(self.method, code, time.perf_counter() - self.start)
        return False


class MetricsInterceptor(CallInterceptor):
    """Reports every call of ``services`` to ``observe`` (the Prometheus RPC metrics)."""

    def __init__(self, observe: RpcObserver, services: Collection[str] | None = None) -> None:
        super().__init__(services)
        self._observe = observe

    def around(self, method: str, request: Any, context: Ctx) -> AbstractAsyncContextManager[None]:
        return _Timed(method, self._observe)


class _Checked:
    __slots__ = ("context", "interceptor", "request")

    def __init__(self, interceptor: SessionInterceptor, request: Any, context: Ctx) -> None:
        self.interceptor = interceptor
        self.request = request
        self.context = context

    async def __aenter__(self) -> None:
        self.interceptor.check(self.request, self.context)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:  # fmt: skip
        return False


class SessionInterceptor(CallInterceptor):
    """Before the handler runs (so a refusal changes nothing): every identifier the request
    has is within ``limits.max_identity_bytes``, and a request that names a ``session_id``
    carries that session's secret (metadata ``x-hicached-session-secret``; PermissionDenied
    otherwise, checked in constant time by the core)."""

    def __init__(
        self, core: HiCacheCore, limits: LimitsConfig, services: Collection[str] | None = None
    ) -> None:
        super().__init__(services)
        self._core = core
        self._limits = limits

    def around(self, method: str, request: Any, context: Ctx) -> AbstractAsyncContextManager[None]:
        return _Checked(self, request, context)

    def check(self, request: Any, context: Ctx) -> None:
        check_ids(request, self._limits)
        session_id = getattr(request, "session_id", "")
        if not session_id:
            return
        secret = ""
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_SECRET_METADATA and isinstance(value, str):
                secret = value
        self._core.check_secret(session_id, secret)


def _deny(code: grpc.StatusCode, message: str, handler: Handler | None) -> Handler:
    """A handler that refuses the call at its headers, for any of the method's four shapes
    (``handler`` None: a method not served, refused as one with a unary answer).

    It takes the request as a stream it never reads, with no deserializer: a handler of a
    unary request makes gRPC read the whole message and parse it before the refusal can run, so
    a caller without the token had a body of up to ``server.max_message_bytes`` read, parsed on
    the event loop and held per stream (a body never finished was held for as long as the
    stranger kept its connection).
    """

    async def refuse(requests: Any, context: Ctx) -> Any:
        await context.abort(code, message)

    serializer = None if handler is None else handler.response_serializer
    if handler is not None and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, response_serializer=serializer)
    return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=serializer)


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses TCP calls without a configured token before any service runs (health excepted;
    reflection included): the listener's authentication, see :class:`Access`."""

    def __init__(self, access: Access) -> None:
        self._access = access

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> Handler:
        handler = await continuation(details)
        method = details.method  # type: ignore[attr-defined]
        if method.startswith(HEALTH_PREFIX):
            return handler
        try:
            self._access.authenticate(details.invocation_metadata)  # type: ignore[attr-defined]
        except Unauthenticated as exc:
            # An unknown method too: without the token a caller learns nothing of what is served.
            return _deny(grpc.StatusCode.UNAUTHENTICATED, str(exc), handler)
        return handler
