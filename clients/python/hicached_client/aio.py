"""Asyncio client (``grpc.aio``): :class:`AsyncHiCacheClient` and :class:`AsyncSession`.

Same method names and arguments as the blocking client; unary methods are
coroutines, ``load`` / ``retract_restore`` return an :class:`AsyncLoadStream`
(an async iterator). A client, its sessions and streams belong to the event
loop they were created on; the heartbeat is a task on that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
from grpc.aio import EOF  # type: ignore[attr-defined]

from hicached_client import _calls, _handoff
from hicached_client._calls import Call, Service
from hicached_client._channel import ChannelConfig, RetryPolicy
from hicached_client.errors import HiCacheError, from_rpc_error
from hicached_client.sync import LEASE_LOST_CODES, new_op_id
from hicached_client.types import (
    AllocResult,
    AttachResult,
    BackupResult,
    ClearNamespaceResult,
    DrainResult,
    GetBytesResult,
    GetPagesResult,
    Keys,
    LoadProgress,
    LoadResult,
    LookupResult,
    PageBytes,
    PageIndices,
    PrefetchPolicy,
    PrefetchStatus,
    PrefetchTicket,
    PublishResult,
    PutBytesResult,
    PutPagesResult,
    ResolveResult,
    RetractBackupResult,
    Stats,
    Transfer,
    WorkerIdentity,
    WriteResult,
)
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc
from hicached_client.v1 import types_pb2 as tpb

T = TypeVar("T")
log = logging.getLogger(__name__)


class AsyncHiCacheClient:
    """Asyncio client of one daemon; ``await client.close()`` (or ``async with``) releases it."""

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float | None = 30.0,
        retry: RetryPolicy | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        kwargs: dict[str, Any] = {"target": target} if target is not None else {}
        self.config = ChannelConfig(
            token=token,
            credentials=credentials,
            timeout_s=timeout_s,
            retry=retry or RetryPolicy(),
            options=options,
            **kwargs,
        )
        self._channel = self.config.aio_channel()
        self._stubs: dict[Service, Any] = {
            Service.HICACHE: pb_grpc.HiCacheServiceStub(self._channel),  # type: ignore[no-untyped-call]
            Service.ADMIN: pb_grpc.AdminServiceStub(self._channel),  # type: ignore[no-untyped-call]
        }
        self._metadata = self.config.metadata()
        # Sessions whose heartbeat uses this channel; stopped before the channel closes.
        self._beating: weakref.WeakSet[AsyncSession] = weakref.WeakSet()

    # ------------------------------------------------------------ plumbing

    @property
    def target(self) -> str:
        return self.config.target

    async def close(self) -> None:
        """Stop the heartbeats of this client's sessions, then close the channel (sessions stay attached)."""
        for session in list(self._beating):
            await session.stop_heartbeat()
        await self._channel.close(grace=None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the channel connects; ``HiCacheError(UNAVAILABLE)`` after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError:
            raise HiCacheError(
                grpc.StatusCode.UNAVAILABLE, f"daemon at {self.target} not reachable within {timeout_s} s"
            ) from None

    def _deadline(self, timeout_s: float | None) -> float | None:
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        return None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _retry_delay(self, attempt: int, error: HiCacheError, deadline: float | None) -> float | None:
        delay = self.config.retry.delay_s(attempt, error)
        remaining = self._remaining(deadline)
        if delay is None or (remaining is not None and remaining <= delay):
            return None
        log.debug("retrying %s in %.3f s (attempt %d): %s", error.method, delay, attempt + 1, error)
        return delay

    async def invoke(self, call: Call[T], timeout_s: float | None = None) -> T:
        """Send a unary call, retrying transient failures with the same request (same op_id)."""
        method = getattr(self._stubs[call.service], call.method)
        deadline = self._deadline(timeout_s)
        attempt = 1
        while True:
            try:
                reply = await method(
                    call.request, timeout=self._remaining(deadline), metadata=self._metadata + call.metadata
                )
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, call.method)
                delay = self._retry_delay(attempt, error, deadline)
                if delay is None:
                    raise error from None
                await asyncio.sleep(delay)  # backoff between retries
                attempt += 1
                continue
            return call.convert(reply)

    def stream(self, call: Call[LoadProgress], timeout_s: float | None = None) -> AsyncLoadStream:
        """Start a server-streaming call; see :class:`AsyncLoadStream`."""
        return AsyncLoadStream(self, call, self._deadline(timeout_s))

    def _start_stream(self, call: Call[Any], deadline: float | None) -> Any:
        method = getattr(self._stubs[call.service], call.method)
        return method(
            call.request, timeout=self._remaining(deadline), metadata=self._metadata + call.metadata
        )

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
    ) -> AsyncSession:
        """Register a worker and its device pools; returns its :class:`AsyncSession`."""
        wire_pools, fds = _handoff.prepare(pools)
        path = _handoff.handoff_path(self.target)
        if path is None and fds:
            raise ValueError(f"fd-exported buffers need a Unix socket target, not {self.target!r}")
        op = op_id or new_op_id()
        stub = self._stubs[Service.HICACHE]
        deadline = self._deadline(timeout_s)
        attempt = 1
        while True:
            try:
                # A ticket serves one Attach: every attempt hands the fds over afresh.
                ticket = ""
                if path is not None:
                    remaining = self._remaining(deadline)
                    got: str | None = await asyncio.to_thread(_handoff.hand_over, path, fds, remaining)
                    ticket = got or ""
                call = _calls.attach(op, identity, wire_pools, lease_ms, ticket)
                try:
                    reply = await stub.Attach(
                        call.request, timeout=self._remaining(deadline), metadata=self._metadata
                    )
                except grpc.RpcError as exc:
                    raise from_rpc_error(exc, call.method) from None
            except HiCacheError as error:
                delay = self._retry_delay(attempt, error, deadline)
                if delay is None:
                    raise
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation
                attempt += 1
                continue
            return AsyncSession(self, call.convert(reply), heartbeat=heartbeat)

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
    """Async iterator of load progress; the same contract as :class:`hicached_client.sync.LoadStream`."""

    def __init__(self, client: AsyncHiCacheClient, call: Call[LoadProgress], deadline: float | None) -> None:
        self._client = client
        self._call = call
        self._deadline = deadline
        self._attempt = 1
        self._received = 0
        self._finished = False
        self._rpc = client._start_stream(call, deadline)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> LoadProgress:
        if self._finished:
            raise StopAsyncIteration
        while True:
            try:
                message = await self._rpc.read()
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, self._call.method)
                delay = (
                    None
                    if self._received
                    else self._client._retry_delay(self._attempt, error, self._deadline)
                )
                if delay is None:
                    self._finished = True
                    raise error from None
                await asyncio.sleep(delay)  # backoff between retries
                self._attempt += 1
                self._rpc = self._client._start_stream(self._call, self._deadline)
                continue
            if message is EOF:
                self._finished = True
                raise HiCacheError(
                    grpc.StatusCode.INTERNAL,
                    f"{self._call.method} stream ended without its final message",
                    method=self._call.method,
                )
            self._received += 1
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


class AsyncSession:
    """The asyncio twin of :class:`hicached_client.sync.Session` (same methods, awaited).

    A worker session: every method carries the session id and a fresh op_id.

    Pass ``op_id=`` to choose the operation id yourself (e.g. the same id on
    every TP rank's retry path). Use as a context manager to detach on exit.
    """

    def __init__(self, client: AsyncHiCacheClient, info: AttachResult, *, heartbeat: bool) -> None:
        self.client = client
        self.info = info
        self._closed = False
        self._lease_lost: HiCacheError | None = None
        self.heartbeats = 0
        self._task: asyncio.Task[None] | None = None
        if heartbeat:
            if info.lease_ms <= 0:
                raise ValueError(
                    f"session {info.session_id}: heartbeat needs a lease, got lease_ms={info.lease_ms}"
                )
            self._task = asyncio.get_running_loop().create_task(
                self._beat(), name=f"hicached-heartbeat-{info.session_id[:8]}"
            )
            client._beating.add(self)

    @property
    def session_id(self) -> str:
        return self.info.session_id

    @property
    def lease_lost(self) -> HiCacheError | None:
        """The heartbeat's fatal error (session unknown / replaced), else ``None``."""
        return self._lease_lost

    @property
    def heartbeat_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _beat(self) -> None:
        interval = self.info.lease_ms / 3000.0
        while True:
            await asyncio.sleep(interval)  # the heartbeat period itself
            try:
                await self.heartbeat(timeout_s=interval)
            except HiCacheError as exc:
                if exc.code in LEASE_LOST_CODES:
                    log.error("session %s lost its lease: %s", self.session_id, exc)
                    self._lease_lost = exc
                    return
                log.warning("session %s heartbeat failed (will retry): %s", self.session_id, exc)

    async def stop_heartbeat(self) -> None:
        """Stop renewing the lease (the session expires after ``lease_ms``)."""
        task = self._task
        if task is None or task is asyncio.current_task():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _op(self, op_id: str | None) -> str:
        return op_id or new_op_id()

    async def _invoke(self, call: Call[T], timeout_s: float | None) -> T:
        return await self.client.invoke(call.signed(self.info.session_secret), timeout_s)

    # -------------------------------------------------------------- lifecycle

    async def detach(self, *, op_id: str | None = None, timeout_s: float | None = None) -> int:
        """End the session; returns the host pages the daemon freed."""
        self._closed = True
        await self.stop_heartbeat()
        return await self._invoke(_calls.detach(self.session_id, self._op(op_id)), timeout_s)

    async def close(self) -> None:
        """Detach unless already detached; a session the daemon already dropped is not an error."""
        if self._closed:
            return
        self._closed = True
        await self.stop_heartbeat()
        try:
            await self._invoke(_calls.detach(self.session_id, new_op_id()), None)
        except HiCacheError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            log.info("session %s was already gone at close: %s", self.session_id, exc)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def heartbeat(self, *, timeout_s: float | None = None) -> int:
        """Extend the lease; returns its new expiry (unix ms)."""
        expiry = await self._invoke(_calls.heartbeat(self.session_id), timeout_s)
        self.heartbeats += 1
        return expiry

    async def stats(self, *, timeout_s: float | None = None) -> Stats:
        """The daemon's view of this session."""
        return await self._invoke(_calls.get_stats(self.session_id), timeout_s)

    # ------------------------------------------------------------ host pages

    async def alloc(
        self, pool: str, num_pages: int, *, op_id: str | None = None, timeout_s: float | None = None
    ) -> AllocResult:
        return await self._invoke(_calls.alloc(self.session_id, self._op(op_id), pool, num_pages), timeout_s)

    async def free(
        self, pool: str, host_pages: PageIndices, *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        return await self._invoke(_calls.free(self.session_id, self._op(op_id), pool, host_pages), timeout_s)

    async def resolve_transfers(
        self,
        transfers: Sequence[Transfer],
        *,
        primary_device_pages: PageIndices | None = None,
        primary_host_pages: PageIndices | None = None,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> ResolveResult:
        call = _calls.resolve_transfers(
            self.session_id, self._op(op_id), transfers, primary_device_pages, primary_host_pages
        )
        return await self._invoke(call, timeout_s)

    async def release_transfers(
        self, transfers: Sequence[Transfer], *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        return await self._invoke(
            _calls.release_transfers(self.session_id, self._op(op_id), transfers), timeout_s
        )

    # ------------------------------------------------------------ data plane

    async def write(
        self,
        transfers: Sequence[Transfer],
        *,
        allocate: bool = False,
        primary_device_pages: PageIndices | None = None,
        primary_host_pages: PageIndices | None = None,
        ready: bytes | None = None,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> WriteResult:
        """Device -> host copy; with ``allocate`` host pages are resolved first (atomically)."""
        call = _calls.write(
            self.session_id,
            self._op(op_id),
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            primary_host_pages=primary_host_pages,
            allocate=allocate,
            ready=ready,
        )
        return await self._invoke(call, timeout_s)

    def load(
        self,
        transfers: Sequence[Transfer],
        *,
        layer_progress: bool = True,
        primary_device_pages: PageIndices | None = None,
        primary_host_pages: PageIndices | None = None,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncLoadStream:
        """Host -> device copy, layer by layer; iterate the stream for per-layer progress."""
        call = _calls.load(
            self.session_id,
            self._op(op_id),
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            primary_host_pages=primary_host_pages,
            layer_progress=layer_progress,
        )
        return self.client.stream(call.signed(self.info.session_secret), timeout_s)

    async def load_wait(self, transfers: Sequence[Transfer], **kwargs: Any) -> LoadResult:
        """:meth:`load` and wait for the end."""
        return await self.load(transfers, **kwargs).wait()

    # ------------------------------------------------------------ retraction

    async def retract_backup(
        self,
        request_id: str,
        transfers: Sequence[Transfer],
        num_tokens: int,
        *,
        lease_ms: int = 0,
        ready: bytes | None = None,
        primary_device_pages: PageIndices | None = None,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> RetractBackupResult:
        call = _calls.retract_backup(
            self.session_id,
            self._op(op_id),
            request_id=request_id,
            transfers=transfers,
            num_tokens=num_tokens,
            lease_ms=lease_ms,
            ready=ready,
            primary_device_pages=primary_device_pages,
        )
        return await self._invoke(call, timeout_s)

    def retract_restore(
        self,
        backup_id: str,
        transfers: Sequence[Transfer],
        *,
        layer_progress: bool = True,
        primary_device_pages: PageIndices | None = None,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncLoadStream:
        call = _calls.retract_restore(
            self.session_id,
            self._op(op_id),
            backup_id=backup_id,
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            layer_progress=layer_progress,
        )
        return self.client.stream(call.signed(self.info.session_secret), timeout_s)

    async def retract_restore_wait(
        self, backup_id: str, transfers: Sequence[Transfer], **kwargs: Any
    ) -> LoadResult:
        return await self.retract_restore(backup_id, transfers, **kwargs).wait()

    async def retract_discard(
        self, backup_id: str, *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        return await self._invoke(
            _calls.retract_discard(self.session_id, self._op(op_id), backup_id), timeout_s
        )

    # --------------------------------------------------------- content cache

    async def lookup(self, keys: Keys, *, tenant: str = "", timeout_s: float | None = None) -> LookupResult:
        return await self._invoke(_calls.lookup(self.session_id, keys, tenant), timeout_s)

    async def publish(
        self,
        keys: Keys,
        transfers: Sequence[Transfer],
        *,
        tenant: str = "",
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PublishResult:
        return await self._invoke(
            _calls.publish(self.session_id, self._op(op_id), keys, transfers, tenant), timeout_s
        )

    async def put_pages(
        self,
        keys: Keys,
        transfers: Sequence[Transfer],
        *,
        primary_device_pages: PageIndices | None = None,
        ready: bytes | None = None,
        tenant: str = "",
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PutPagesResult:
        call = _calls.put_pages(
            self.session_id,
            self._op(op_id),
            keys=keys,
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            ready=ready,
            tenant=tenant,
        )
        return await self._invoke(call, timeout_s)

    async def get_pages(
        self,
        keys: Keys,
        transfers: Sequence[Transfer],
        *,
        primary_device_pages: PageIndices | None = None,
        include_l3: bool = False,
        tenant: str = "",
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> GetPagesResult:
        call = _calls.get_pages(
            self.session_id,
            self._op(op_id),
            keys=keys,
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            include_l3=include_l3,
            tenant=tenant,
        )
        return await self._invoke(call, timeout_s)

    async def prefetch(
        self,
        keys: Keys,
        *,
        policy: PrefetchPolicy | str = PrefetchPolicy.BEST_EFFORT,
        timeout_ms: int = 0,
        tenant: str = "",
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PrefetchTicket:
        call = _calls.prefetch(
            self.session_id, self._op(op_id), keys=keys, policy=policy, timeout_ms=timeout_ms, tenant=tenant
        )
        return await self._invoke(call, timeout_s)

    async def prefetch_status(
        self, prefetch_id: str, *, wait: bool = False, timeout_s: float | None = None
    ) -> PrefetchStatus:
        return await self._invoke(_calls.prefetch_status(self.session_id, prefetch_id, wait), timeout_s)

    async def cancel_prefetch(
        self, prefetch_id: str, *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        return await self._invoke(
            _calls.cancel_prefetch(self.session_id, self._op(op_id), prefetch_id), timeout_s
        )

    async def backup(
        self,
        keys: Keys,
        *,
        wait: bool = False,
        tenant: str = "",
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> BackupResult:
        """Queue an L2 -> L3 backup of cached keys; with ``wait``, return once they are stored."""
        return await self._invoke(
            _calls.backup(self.session_id, self._op(op_id), keys, tenant, wait), timeout_s
        )

    async def put_bytes(
        self,
        pages: Sequence[PageBytes],
        *,
        tenant: str = "",
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PutBytesResult:
        return await self._invoke(
            _calls.put_bytes(self.session_id, self._op(op_id), pages, tenant), timeout_s
        )

    async def get_bytes(
        self, keys: Keys, *, include_l3: bool = False, tenant: str = "", timeout_s: float | None = None
    ) -> GetBytesResult:
        return await self._invoke(_calls.get_bytes(self.session_id, keys, include_l3, tenant), timeout_s)
