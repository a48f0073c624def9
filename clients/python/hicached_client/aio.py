"""The client of one daemon: :class:`AsyncHiCacheClient` and its :class:`AsyncLoadStream`.

One source, two clients: the asyncio client (``grpc.aio``; ``aio.py`` and ``_aio_session.py``)
is written by hand, and the blocking client (``sync.py`` and ``_sync_session.py``) is generated
from it by ``tools/unasync.py`` (``./dev unasync``), so both have the same methods, arguments
and behaviour; they differ only where ``_aio_backend.py`` and ``_sync_backend.py`` do.

Retries are the channel's (:class:`~hicached_client.RetryPolicy` as a gRPC service config):
a transient failure re-sends the very same request, ``op_id`` included.

Thread-safety: a blocking client and its sessions may be used from many threads at once
(gRPC channels are thread-safe); an asyncio client, its sessions and streams belong to the
event loop they were created on. A load stream belongs to the thread or task iterating it.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any, Self, TypeVar

import grpc

from hicached_client import _aio_backend as backend
from hicached_client import _calls, _handoff
from hicached_client._aio_session import AsyncSession
from hicached_client._calls import Call, Line, Service, new_op_id
from hicached_client._channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_RECEIVE_BYTES,
    ChannelConfig,
    RetryPolicy,
)
from hicached_client.errors import ClientClosedError, HiCacheError, from_rpc_error, start_failure
from hicached_client.types import (
    AttachResult,
    ClearNamespaceResult,
    DrainResult,
    LoadProgress,
    LoadResult,
    Stats,
    WorkerIdentity,
)
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc
from hicached_client.v1 import types_pb2 as tpb

T = TypeVar("T")
log = logging.getLogger(__name__)
# How often wait_ready looks again for a socket directory that does not exist yet.
_DIR_POLL_S = 0.05


class AsyncHiCacheClient:
    """Client of one daemon; close it (or use it as a context manager) to release its channels:
    one for every call, one of its own for the heartbeats (:class:`~hicached_client._calls.Line`).

    ``target``: ``unix:///path.sock``, a socket path, or ``host:port`` (default:
    :func:`hicached_client.default_target`). ``timeout_s`` is each call's overall deadline,
    retries included. ``fast_lane``: sessions send their hot operations over the daemon's
    fast lane where it has one (see the session's docstring and docs/fastlane.md).
    ``max_message_bytes``: the largest message the channel sends or accepts (256 MiB, room for
    large PutBytes batches). ``max_receive_bytes``: the largest answer it accepts (64 MiB, the
    most a daemon at its default ``server.max_message_bytes`` sends; raise it with the daemon's
    limits); an answer is parsed and converted whole, so this is what one call may make the
    worker allocate, whatever the daemon (or an impostor) answers.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float | None = 30.0,
        retry: RetryPolicy | None = None,
        options: Sequence[tuple[str, Any]] = (),
        fast_lane: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
    ) -> None:
        kwargs: dict[str, Any] = {"target": target} if target is not None else {}
        self.config = ChannelConfig(
            token=token,
            credentials=credentials,
            timeout_s=timeout_s,
            retry=retry or RetryPolicy(),
            max_message_bytes=max_message_bytes,
            max_receive_bytes=max_receive_bytes,
            options=options,
            **kwargs,
        )
        self._channel = self.config.aio_channel()
        # The heartbeats' connection (see Line), one per process: gRPC connects it at the first.
        self._beat_channel = self.config.aio_channel(heartbeats=True)
        self._stubs: dict[tuple[Service, Line], Any] = {
            (Service.HICACHE, Line.DATA): pb_grpc.HiCacheServiceStub(self._channel),  # type: ignore[no-untyped-call]
            (Service.ADMIN, Line.DATA): pb_grpc.AdminServiceStub(self._channel),  # type: ignore[no-untyped-call]
            (Service.HICACHE, Line.HEARTBEAT): pb_grpc.HiCacheServiceStub(self._beat_channel),  # type: ignore[no-untyped-call]
        }
        self._metadata = self.config.metadata()
        self._closed = False
        self._dir_checked = False  # _handoff.check_socket_dir passed (see _check_dir)
        self.fast_lane = fast_lane
        # Sessions of this client: their heartbeats and fast lanes end before the channel closes.
        self._sessions: weakref.WeakSet[AsyncSession] = weakref.WeakSet()

    # ------------------------------------------------------------ plumbing

    @property
    def target(self) -> str:
        return self.config.target

    async def close(self) -> None:
        """Stop the heartbeats and close the fast lanes of this client's sessions, then close the
        channels (always; idempotent). The sessions stay attached (until their lease runs out);
        any later call raises :class:`~hicached_client.ClientClosedError`."""
        self._closed = True
        try:
            for session in list(self._sessions):
                await session.stop_heartbeat()
                await session._slot.close()
        finally:
            try:
                await backend.close_channel(self._beat_channel)
            finally:
                await backend.close_channel(self._channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the channel connects; ``HiCacheError(UNAVAILABLE)`` after ``timeout_s``.
        The socket's directory is checked first, as before a call: connecting is what hands a
        stranger the channel. A directory that does not exist yet (a daemon starting makes it)
        is looked for again every 50 ms; still missing at ``timeout_s``, its UNAVAILABLE names it."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._check_dir()
                break
            except HiCacheError as exc:
                left = deadline - time.monotonic()
                if exc.code != grpc.StatusCode.UNAVAILABLE or left <= 0:
                    raise
                await backend.pause(min(_DIR_POLL_S, left))
        if not await backend.channel_ready(self._channel, max(0.0, deadline - time.monotonic())):
            raise HiCacheError(
                grpc.StatusCode.UNAVAILABLE, f"daemon at {self.target} not reachable within {timeout_s} s"
            )

    def _check_dir(self) -> None:
        """Before anything may connect: the socket's directory (:func:`_handoff.check_socket_dir`),
        until it passed once (its failures, a missing directory included, raise and send nothing)."""
        if not self._dir_checked:
            _handoff.check_socket_dir(self.target)
            self._dir_checked = True

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.config.timeout_s if timeout_s is None else timeout_s

    def _start_failure(self, exc: Exception, method: str) -> HiCacheError:
        """A call gRPC did not start, as the error both clients raise (closed: ClientClosedError)."""
        return start_failure(exc, method, self._closed or isinstance(exc, backend.CLOSED_ERRORS))

    async def invoke(self, call: Call[T], timeout_s: float | None = None) -> T:
        """Send a unary call (the channel retries transient failures with the same request).
        A heartbeat whose connection is UNAVAILABLE (e.g. the daemon, at
        ``server.max_connections``, refused it) goes once more on the data calls' connection,
        with a warning: a lease must not end while data calls still get through."""
        if self._closed:
            raise ClientClosedError(call.method)
        self._check_dir()
        method = getattr(self._stubs[call.service, call.line], call.method)
        try:
            reply = await method(
                call.request, timeout=self._timeout(timeout_s), metadata=self._metadata + call.metadata
            )
        except grpc.RpcError as exc:
            error = self._closed_under(call.method) or from_rpc_error(exc, call.method)
            if call.line is Line.HEARTBEAT and error.code == grpc.StatusCode.UNAVAILABLE:
                beat = await self.invoke(replace(call, line=Line.DATA), timeout_s)
                # Said once the beat got through: a daemon that is down fails both
                # connections, and the session's own warning says so, once a beat.
                log.warning("heartbeat connection failed (%s): beating on the data connection", error)
                return beat
            raise error from None
        except backend.START_ERRORS as exc:
            raise self._start_failure(exc, call.method) from None
        except backend.CANCELLED_ERRORS:
            closed = self._closed_under(call.method)
            if closed is None:
                raise
            raise closed from None
        return call.convert(reply)

    def _closed_under(self, method: str) -> ClientClosedError | None:
        """The error of a call that :meth:`close` ended under way (CANCELLED either way: the
        same class as a call after the close), else None."""
        return ClientClosedError(method) if self._closed and backend.cancelled_by_close() else None

    def stream(self, call: Call[LoadProgress], timeout_s: float | None = None) -> AsyncLoadStream:
        """Start a server-streaming call; see :class:`AsyncLoadStream`."""
        if self._closed:
            raise ClientClosedError(call.method)
        self._check_dir()
        return AsyncLoadStream(self, call, self._timeout(timeout_s))

    def _start_stream(self, call: Call[LoadProgress], timeout_s: float | None) -> Any:
        """One try of a stream's RPC (see :class:`AsyncLoadStream` for the others)."""
        method = getattr(self._stubs[call.service, call.line], call.method)
        try:
            return method(call.request, timeout=timeout_s, metadata=self._metadata + call.metadata)
        except backend.START_ERRORS as exc:
            raise self._start_failure(exc, call.method) from None

    # ------------------------------------------------------------- sessions

    async def attach(
        self,
        identity: WorkerIdentity,
        pools: Sequence[tpb.PoolSpec],
        *,
        lease_ms: int = 0,
        heartbeat: bool = True,
        op_id: str | None = None,
        timeout_s: float | None = None,
        join_only: bool = False,
    ) -> AsyncSession:
        """Register a worker and its device pools; returns its :class:`AsyncSession`.

        With ``heartbeat`` the session renews its lease every ``lease_ms / 3`` until it is
        detached or closed. Device buffers (fds) are handed over first on the
        ``<socket>.fds`` socket; the ticket serves one Attach, so Attach is not retried.
        With ``join_only`` the daemon only joins an existing pool group of this model and
        layout: NOT_FOUND, creating nothing, when it has none (see ``hicached lookup``).
        """
        wire_pools, fds = _handoff.prepare(pools)
        path = _handoff.handoff_path(self.target)
        if path is None and fds:
            raise ValueError(f"fd-exported buffers need a Unix socket target, not {self.target!r}")
        timeout = self._timeout(timeout_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = "" if path is None else (await backend.hand_over(path, fds, timeout)) or ""
        call = _calls.attach(op_id or new_op_id(), identity, wire_pools, lease_ms, ticket, join_only)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        result = await self.invoke(call, left)
        return AsyncSession(self, result, heartbeat=heartbeat)

    def session(
        self, session_id: str, *, lease_ms: int = 0, heartbeat: bool = False, session_secret: str = ""
    ) -> AsyncSession:
        """A handle on an existing session (no call is made; no heartbeat by default).

        ``session_secret`` is the one its Attach returned: without it the daemon refuses
        every call of the session (PERMISSION_DENIED).
        """
        info = AttachResult(
            session_id=session_id,
            lease_ms=lease_ms,
            pools=(),
            joined_existing_group=False,
            replaced_session_id="",
            session_secret=session_secret,
        )
        return AsyncSession(self, info, heartbeat=heartbeat)

    # --------------------------------------------------- daemon-wide calls

    async def get_stats(self, session_id: str = "", *, timeout_s: float | None = None) -> Stats:
        """The daemon's state (``session_id`` = only that session's view; that needs the
        session's secret, so use the session's ``stats()`` -- PERMISSION_DENIED otherwise)."""
        return await self.invoke(_calls.get_stats(session_id), timeout_s)

    async def ping(self, payload: bytes = b"", *, timeout_s: float | None = None) -> bytes:
        return await self.invoke(_calls.ping(payload), timeout_s)

    async def drain(self, *, wait_flush: bool = False, timeout_s: float | None = None) -> DrainResult:
        return await self.invoke(_calls.drain(wait_flush), timeout_s)

    async def resume(self, *, timeout_s: float | None = None) -> bool:
        """Undo a Drain (admin); True when the daemon was draining."""
        return await self.invoke(_calls.resume(), timeout_s)

    async def clear_namespace(
        self,
        model_name: str,
        tenant: str = "",
        *,
        session_id: str = "",
        session_secret: str = "",
        timeout_s: float | None = None,
    ) -> ClearNamespaceResult:
        """Admin: any model/tenant. A worker: its own, naming one of its sessions (``session_id``)."""
        call = _calls.clear_namespace(model_name, tenant, session_id).signed(session_secret)
        return await self.invoke(call, timeout_s)


class AsyncLoadStream(AsyncIterator[LoadProgress]):
    """Progress of a Load / RetractRestore, one item per finished layer, then a final one.

    The RPC starts when the stream is created. After a transient failure before the first
    message the stream re-sends the same request (same op_id) under the client's retry policy,
    within the call's deadline (``RetryPolicy.stream_retry_s``); after that a failure raises.
    ``cancel()`` abandons the load (the daemon stops it); ``wait()`` consumes the stream and
    returns a :class:`LoadResult`.
    """

    def __init__(self, client: AsyncHiCacheClient, call: Call[LoadProgress], timeout_s: float | None) -> None:
        self._client = client
        self._call = call
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._tries = 1
        self._received = False  # a message came: no more tries
        self._finished = False
        self._rpc = client._start_stream(call, timeout_s)

    def _cancelled(self) -> HiCacheError:
        return HiCacheError(grpc.StatusCode.CANCELLED, "the stream was cancelled", method=self._call.method)

    def _retry_s(self, error: HiCacheError) -> float | None:
        if self._received or self._finished or isinstance(error, ClientClosedError):
            return None
        left = None if self._deadline is None else self._deadline - time.monotonic()
        return self._client.config.retry.stream_retry_s(self._tries, error.code, error.retry_after_ms, left)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> LoadProgress:
        if self._finished:
            raise StopAsyncIteration
        try:
            while True:
                try:
                    message = await backend.next_message(self._rpc)
                    break
                except grpc.RpcError as exc:
                    error = self._client._closed_under(self._call.method) or from_rpc_error(
                        exc, self._call.method
                    )
                    pause = self._retry_s(error)
                    if pause is None:
                        raise error from None
                await backend.pause(pause)
                if self._finished:  # cancelled during the pause
                    raise self._cancelled()
                self._tries += 1
                left = None if self._deadline is None else self._deadline - time.monotonic()
                self._rpc = self._client._start_stream(self._call, left)
                if self._finished:  # cancelled (another thread) while the try started: not run
                    self._rpc.cancel()
                    raise self._cancelled()
        except HiCacheError:
            self._finished = True
            raise
        except backend.START_ERRORS as exc:
            self._finished = True
            raise self._client._start_failure(exc, self._call.method) from None
        except backend.CANCELLED_ERRORS:
            self._finished = True
            closed = self._client._closed_under(self._call.method)
            if closed is None:
                raise
            raise closed from None
        if message is None:
            self._finished = True
            raise HiCacheError(
                grpc.StatusCode.INTERNAL,
                f"{self._call.method} stream ended without its final message",
                method=self._call.method,
            )
        self._received = True
        progress = self._call.convert(message)
        self._finished = progress.done
        return progress

    def cancel(self) -> None:
        self._finished = True
        self._rpc.cancel()

    async def wait(self) -> LoadResult:
        layers: list[int] = []
        async for progress in self:
            if progress.done:
                return LoadResult(layers=tuple(layers), acks=progress.acks)
            layers.append(progress.layer)
        raise HiCacheError(
            grpc.StatusCode.INTERNAL, f"{self._call.method} stream ended without its final message"
        )


__all__ = ["AsyncHiCacheClient", "AsyncLoadStream", "AsyncSession", "new_op_id"]
