"""The per-call interceptors over a real grpc.aio server: one path for unary and streaming.

A small service with raw-bytes methods sits behind the daemon's own chain (decode, errors,
metrics); each method raises what a servicer could. Unary and server-streaming calls must get
the same codes, messages, retry hints and observations — before the interceptors, the mapping
was written twice (the unary decorator and the Load stream) and could drift.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from hicached.errors import InvalidArgument, NotFound, ResourceExhausted
from hicached.server.decode import DecodeInterceptor
from hicached.server.interceptors import MAX_MESSAGE_CHARS, ErrorInterceptor, MetricsInterceptor

SERVICE = "test.Toy"
FAILURES: dict[bytes, Exception] = {
    b"not-found": NotFound("no session 'x'"),
    b"busy": ResourceExhausted("queue full", retry_after_ms=25),
    b"bug": ZeroDivisionError("a bug"),
    b"long": InvalidArgument("y" * 5000),
}


async def _unary(request: bytes, context: Any) -> bytes:
    if request in FAILURES:
        raise FAILURES[request]
    return b"ok:" + request


async def _stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield b"first"
    if request in FAILURES:
        raise FAILURES[request]
    yield b"ok:" + request


def _identity(b: bytes) -> bytes:
    return b


HANDLERS = grpc.method_handlers_generic_handler(
    SERVICE,
    {
        "Unary": grpc.unary_unary_rpc_method_handler(
            _unary, request_deserializer=_identity, response_serializer=_identity
        ),
        "Stream": grpc.unary_stream_rpc_method_handler(
            _stream, request_deserializer=_identity, response_serializer=_identity
        ),
    },
)

Outcome = tuple[grpc.StatusCode, str, dict[str, str], list[bytes]]


async def _run(requests: list[tuple[str, bytes]]) -> tuple[list[Outcome], list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []

    class Observe:
        def on_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
            assert seconds >= 0
            seen.append((method, code.name))

    server = grpc.aio.server(
        interceptors=(
            DecodeInterceptor(max_request_bytes=1 << 20, max_put_pages=16),
            ErrorInterceptor([SERVICE]),
            MetricsInterceptor(Observe(), [SERVICE]),
        )
    )
    server.add_generic_rpc_handlers((HANDLERS,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    outcomes: list[Outcome] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method, payload in requests:
                got: list[bytes] = []
                if method == "Unary":
                    call: Any = channel.unary_unary(f"/{SERVICE}/Unary")(payload)
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        got.append(await call)
                else:
                    call = channel.unary_stream(f"/{SERVICE}/Stream")(payload)
                    try:
                        async for reply in call:
                            got.append(reply)
                    except grpc.aio.AioRpcError:
                        pass
                trailers = {k: v for k, v in (await call.trailing_metadata() or ())}
                outcomes.append((await call.code(), await call.details() or "", trailers, got))
    finally:
        await server.stop(None)
    return outcomes, seen


@pytest.mark.parametrize("method", ["Unary", "Stream"])
def test_errors_map_the_same_way_for_unary_and_streaming(method: str) -> None:
    payloads = [b"fine", b"not-found", b"busy", b"bug", b"long"]
    outcomes, seen = asyncio.run(_run([(method, p) for p in payloads]))
    codes = [o[0] for o in outcomes]
    assert codes == [
        grpc.StatusCode.OK,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]
    ok, missing, busy, bug, long = outcomes
    assert ok[3][-1] == b"ok:fine"
    assert missing[1] == "no session 'x'"
    assert busy[2].get("grpc-retry-pushback-ms") == "25"
    assert "grpc-retry-pushback-ms" not in missing[2]
    assert bug[1] == f"internal error in {method}: ZeroDivisionError: a bug"
    assert len(long[1]) < MAX_MESSAGE_CHARS + 40 and long[1].endswith("... (5000 chars)")
    if method == "Stream":  # what was streamed before the error still arrived
        assert all(o[3][0] == b"first" for o in outcomes)
    assert seen == [
        (method, "OK"),
        (method, "NOT_FOUND"),
        (method, "RESOURCE_EXHAUSTED"),
        (method, "INTERNAL"),
        (method, "INVALID_ARGUMENT"),
    ]
