"""The gRPC health service (``grpc.health.v1.Health``), answering only for the daemon's names.

Health is open on every listener, TCP included (probes carry no token), so what a caller can
make it hold must not depend on what the caller sends. The stock ``grpc_health`` servicer kept
every Watch request and a status entry per name it was asked about: 200 Watch streams naming
1 MB services grew the daemon by 811 MiB for as long as they stayed open. Here:

* the names are fixed when the daemon starts (``""`` and its services); a request is refused
  before it is parsed when it is longer than a name can be (:data:`MAX_NAME_BYTES`), and a
  name the daemon does not serve is refused at once, quoted by a short prefix only, never
  kept;
* the Watch streams open on one listener are at most ``server.max_health_watchers``; more are
  RESOURCE_EXHAUSTED (each listener counts its own, so strangers on TCP cannot take the Unix
  socket's watchers);
* ``enter_graceful_shutdown`` turns every name NOT_SERVING for good, as the stock one did.

Thread-safety: everything runs on the daemon's event loop; :class:`HealthStatus` and
:class:`HealthServicer` are not meant to be touched from other threads. The
:class:`HealthStatus` is owned by ``app.Server``; each listener's servicer only reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

__all__ = ["MAX_NAME_BYTES", "SERVICE_NAME", "HealthServicer", "HealthStatus"]

SERVICE_NAME = "grpc.health.v1.Health"
# Longest service name answered; gRPC service names are far shorter (ours: 27 bytes).
MAX_NAME_BYTES = 256
# A HealthCheckRequest of a name of MAX_NAME_BYTES: tag (1 byte), length (2), the name.
_MAX_REQUEST_BYTES = MAX_NAME_BYTES + 3
# How much of a refused name the message quotes.
_QUOTED_CHARS = 64

# A HealthCheckResponse.ServingStatus (an int; grpc_health ships no type information).
Status = int
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthStatus:
    """The serving status of the daemon's fixed names, and a wake-up for their watchers.

    ``""`` (liveness) starts SERVING, as the stock servicer's did; the others NOT_SERVING
    until ``set`` (they are known from the start, so a probe before then is told "not yet"
    rather than NOT_FOUND). Event-loop only.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._status: dict[str, Status] = dict.fromkeys(names, NOT_SERVING)
        self._status[""] = SERVING
        self._changed = asyncio.Event()
        self._shutting_down = False

    def get(self, name: str) -> Status | None:
        """The status of ``name``; None for a name the daemon does not serve."""
        return self._status.get(name)

    @property
    def changed(self) -> asyncio.Event:
        """Set at the next change of any status (take it before reading, so no change is missed)."""
        return self._changed

    def set(self, name: str, status: Status) -> None:
        """Sets a known name's status; ignored after :meth:`enter_graceful_shutdown`. KeyError
        for a name the daemon does not serve (a bug: the names are fixed at start)."""
        if self._shutting_down:
            return
        self._set(name, status)

    def enter_graceful_shutdown(self) -> None:
        """Every name NOT_SERVING, for good (later ``set`` calls are ignored)."""
        self._shutting_down = True
        for name in self._status:
            self._set(name, NOT_SERVING)

    def _set(self, name: str, status: Status) -> None:
        if name not in self._status:
            raise KeyError(f"health: {name!r} is not one of the daemon's services")
        if self._status[name] == status:
            return
        self._status[name] = status
        # A new event per change: the watchers woken by the old one read the new status.
        woken, self._changed = self._changed, asyncio.Event()
        woken.set()


class _Oversized:
    """Stands for a request longer than any name answered: never parsed."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


def _parse(raw: bytes) -> health_pb2.HealthCheckRequest | _Oversized:
    # Bounded before parsing: gRPC parses on the event loop, and a parsed name is a copy.
    if len(raw) > _MAX_REQUEST_BYTES:
        return _Oversized(len(raw))
    return health_pb2.HealthCheckRequest.FromString(raw)


def _quoted(name: str) -> str:
    if len(name) <= _QUOTED_CHARS:
        return repr(name)
    return f"{name[:_QUOTED_CHARS]!r}... ({len(name.encode())} bytes)"


class HealthServicer:
    """Check and Watch of one listener over the shared :class:`HealthStatus`; at most
    ``max_watchers`` Watch streams at once on this listener. Event-loop only; the watcher
    count is this servicer's own."""

    def __init__(self, status: HealthStatus, *, max_watchers: int) -> None:
        self._status = status
        self._max_watchers = max_watchers
        self._watchers = 0

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers Check and Watch with their bounded request parser."""
        serialize = health_pb2.HealthCheckResponse.SerializeToString
        handlers = {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.Check, request_deserializer=_parse, response_serializer=serialize
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self.Watch, request_deserializer=_parse, response_serializer=serialize
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))

    async def _known(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The requested name, or the call ends NOT_FOUND (the health protocol's answer to a
        service the server does not know) quoting at most a prefix of it."""
        if isinstance(request, _Oversized):
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"health request of {request.size} bytes: no service name is longer than "
                f"{MAX_NAME_BYTES} bytes",
            )
        name: str = request.service
        if self._status.get(name) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {_quoted(name)}")
        return name

    async def Check(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        name = await self._known(request, context)
        return health_pb2.HealthCheckResponse(status=self._status.get(name))

    async def Watch(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        # An unknown name ends the stream NOT_FOUND without a message. The protocol would send
        # SERVICE_UNKNOWN and keep the stream open in case the service appears later; ours are
        # fixed at start, so it never would, and an open stream is what a stranger must not be
        # able to keep. Not SERVICE_UNKNOWN-then-end either: gRPC's client-side health checker
        # restarts a stream that had a response at once, without backoff (a misconfigured client
        # would spin on us), and retries a call that failed before any response with backoff.
        name = await self._known(request, context)
        if self._watchers >= self._max_watchers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._watchers} health Watch streams are open on this listener "
                f"(server.max_health_watchers={self._max_watchers}); use Check, or retry later",
            )
        self._watchers += 1
        try:
            last: Status | None = None
            while True:
                changed = self._status.changed
                status = self._status.get(name)
                if status != last:
                    last = status
                    yield health_pb2.HealthCheckResponse(status=status)
                await changed.wait()
        finally:
            self._watchers -= 1
