"""A server interceptor that bounds what the daemon parses, and answers an undecodable
request INVALID_ARGUMENT.

gRPC parses a request on the event loop before any handler runs, and protobuf allocates
per element: a request of tiny elements costs up to ~25 ms and ~36 MiB per MiB on the wire
(measured; 63 MiB of empty PutBytes pages held the loop 3.4 s and grew the daemon 2.4 GiB).
So every method's deserializer is wrapped: a request over ``limits.max_request_bytes`` is
not parsed, and a PutBytes (the one request that carries page data, up to
``server.max_message_bytes``) is parsed only once a scan of its top-level fields found at
most ``limits.max_keys_per_request`` pages. Either becomes a :class:`Refused` marker
(RESOURCE_EXHAUSTED naming the key); bytes that do not parse become one too
(INVALID_ARGUMENT; grpc's own handling would answer UNKNOWN with an error-level traceback).
The wrapped behaviour answers the marker before the servicer — and anything that could
change state — runs.

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

__all__ = ["DecodeInterceptor", "Refused"]

# PutBytesRequest.pages: the one repeated field of the one request allowed past max_request_bytes.
_PUT_BYTES_PAGES = 3


class Refused:
    """Stands for a request that was not parsed (too large, too many pages) or did not parse."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message


def _undecodable(method: str, size: int, error: BaseException) -> Refused:
    reason = str(error)[:120]
    return Refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"undecodable {method} request ({size} bytes): {type(error).__name__}: {reason}",
    )


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; IndexError past the end."""
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


# Top-level fields a PutBytesRequest has besides its pages (session_id, op_id, tenant), with room.
_OTHER_FIELDS = 16


def count_field(raw: bytes, field: int, most: int) -> int | None:
    """How many times top-level ``field`` occurs in the message ``raw``; past ``most`` (of it,
    or of all fields less :data:`_OTHER_FIELDS`) the walk stops and says ``most`` + 1. None for
    bytes that are no message (the parser then says why). Walks only the top level (a
    length-delimited field is skipped whole), never more than ``most`` + 1 + _OTHER_FIELDS
    fields: unknown fields cannot make it long either."""
    pos, n, seen, fields = 0, len(raw), 0, 0
    try:
        while pos < n:
            fields += 1
            if fields > most + _OTHER_FIELDS:
                return most + 1
            tag, pos = _varint(raw, pos)
            kind = tag & 7
            if kind == 0:
                _, pos = _varint(raw, pos)
            elif kind == 1:
                pos += 8
            elif kind == 2:
                length, pos = _varint(raw, pos)
                pos += length
            elif kind == 5:
                pos += 4
            else:
                return None
            if tag >> 3 == field:
                seen += 1
                if seen > most:
                    return seen
    except (IndexError, ValueError):
        return None
    return seen if pos == n else None


def _bounded(
    deserialize: Callable[[bytes], Any] | None, method: str, max_bytes: int, max_pages: int
) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    put_bytes = method == "PutBytes"

    def decode(raw: bytes) -> Any:
        if put_bytes:
            pages = count_field(raw, _PUT_BYTES_PAGES, max_pages)
            if pages is not None and pages > max_pages:
                return Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"PutBytes request of more than {max_pages} pages (or fields) exceeds "
                    f"limits.max_keys_per_request={max_pages} (counted before parsing)",
                )
        elif len(raw) > max_bytes:
            return Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method} request of {len(raw)} bytes exceeds limits.max_request_bytes={max_bytes}: "
                "split it (a request is parsed before any other limit is checked)",
            )
        try:
            return deserialize(raw)
        except Exception as exc:  # protobuf's DecodeError, or anything a parser raises
            return _undecodable(method, len(raw), exc)

    return decode


class _Refuse:
    """The status of a request that was refused before parsing or did not parse, before the
    handler runs."""

    __slots__ = ("context", "method", "request")

    def __init__(self, method: str, request: Any, context: Ctx) -> None:
        self.method = method
        self.request = request
        self.context = context

    async def __aenter__(self) -> None:
        if isinstance(self.request, Refused):
            await self.context.abort(self.request.code, self.request.message)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:  # fmt: skip
        return False


class DecodeInterceptor(CallInterceptor):
    """Wraps the unary-request handlers of every service (every RPC of the daemon's services
    has one request): a bounded, tolerant deserializer, and the refusal of what it refused.
    ``max_request_bytes``: the largest request parsed (PutBytes excepted); ``max_put_pages``:
    the most pages of a PutBytes parsed."""

    def __init__(self, *, max_request_bytes: int, max_put_pages: int) -> None:
        super().__init__()
        self._max_bytes = max_request_bytes
        self._max_pages = max_put_pages

    def deserializer(
        self, inner: Callable[[bytes], Any] | None, method: str
    ) -> Callable[[bytes], Any] | None:
        return _bounded(inner, method, self._max_bytes, self._max_pages)

    def around(self, method: str, request: Any, context: Ctx) -> AbstractAsyncContextManager[None]:
        return _Refuse(method, request, context)
