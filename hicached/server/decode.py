"""A server interceptor that answers an undecodable request INVALID_ARGUMENT.

grpc's own handling turns a deserializer's exception into UNKNOWN with an
error-level traceback. Here every method's deserializer is wrapped: bytes that
do not parse become an :class:`Undecodable` marker instead, and the wrapped
behaviour answers it INVALID_ARGUMENT (naming the method and the size) before
the servicer — and anything that could change state — runs.

Thread-safety: stateless; handlers are wrapped once per method and cached
(:class:`hicached.server.interceptors.CallInterceptor`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import grpc

from hicached.server.interceptors import CallInterceptor, Ctx

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


class _Refuse:
    """INVALID_ARGUMENT for an undecodable request, before the handler runs."""

    __slots__ = ("context", "method", "request")

    def __init__(self, method: str, request: Any, context: Ctx) -> None:
        self.method = method
        self.request = request
        self.context = context

    async def __aenter__(self) -> None:
        if isinstance(self.request, Undecodable):
            await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.request.message(self.method))

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:  # fmt: skip
        return False


class DecodeInterceptor(CallInterceptor):
    """Wraps the unary-request handlers of every service (every RPC of the daemon's services
    has one request): a tolerant deserializer, and the refusal of what it could not parse."""

    def deserializer(self, inner: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
        return _tolerant(inner)

    def around(self, method: str, request: Any, context: Ctx) -> AbstractAsyncContextManager[None]:
        return _Refuse(method, request, context)
