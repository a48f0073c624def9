"""A server interceptor that answers an undecodable request INVALID_ARGUMENT.

grpc's own handling turns a deserializer's exception into UNKNOWN with an
error-level traceback. Here every method's deserializer is wrapped: bytes that
do not parse become an :class:`Undecodable` marker instead, and the wrapped
behaviour answers it INVALID_ARGUMENT (naming the method and the size) before
the servicer — and anything that could change state — runs.

Thread-safety: stateless; handlers are wrapped once per method and cached.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

__all__ = ["DecodeInterceptor", "Undecodable"]


class Undecodable:
    """Stands for a request whose bytes did not parse."""

    def __init__(self, size: int, error: BaseException) -> None:
        self.size = size
        self.error = error

    def message(self, method: str) -> str:
        reason = str(self.error)[:120]
        return f"undecodable {method} request ({self.size} bytes): {type(self.error).__name__}: {reason}"


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # protobuf's DecodeError, or anything a parser raises
            return Undecodable(len(raw), exc)

    return decode


class DecodeInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Wraps unary-request handlers (every RPC of the daemon's services has one request)."""

    def __init__(self) -> None:
        self._cache: dict[str, grpc.RpcMethodHandler[Any, Any] | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        method = details.method  # type: ignore[attr-defined]
        if method not in self._cache:
            self._cache[method] = _wrap(handler, str(method).rpartition("/")[2])
        return self._cache[method] or handler


def _wrap(handler: grpc.RpcMethodHandler[Any, Any], name: str) -> grpc.RpcMethodHandler[Any, Any] | None:
    """The handler with a tolerant deserializer; None (leave it as is) for a sync handler."""
    decode = _tolerant(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
        inner = handler.unary_unary

        async def unary(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(name))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=decode, response_serializer=serialize
        )
    stream_inner = handler.unary_stream
    if stream_inner is not None and inspect.isasyncgenfunction(stream_inner):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(name))
            async for reply in stream_inner(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=decode, response_serializer=serialize
        )
    if stream_inner is not None and inspect.iscoroutinefunction(stream_inner):  # writes with context.write

        async def writer(request: Any, context: Any) -> None:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(name))
            await stream_inner(request, context)

        return grpc.unary_stream_rpc_method_handler(
            writer, request_deserializer=decode, response_serializer=serialize
        )
    return None
