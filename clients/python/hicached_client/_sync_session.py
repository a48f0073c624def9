# Generated from _aio_session.py by tools/unasync.py (./dev unasync). Do not edit.
"""A worker session: :class:`Session` (``_sync_session.py`` is generated from it: ``aio.py``).

Every method carries the session id, the session's secret and an op_id (fresh, or the caller's
``op_id=``: e.g. the same id on every TP rank's retry path), so a retried call is answered once.
With ``fast_lane=True`` on the client, the hot calls go over the daemon's fast lane when they can
(docs/fastlane.md says which; a lost lane re-sends the op over gRPC with the same op_id, so it
runs once, within what is left of its timeout). Results and errors are the same.

Thread-safety: a blocking session may be used from many threads (its mutable state -- the Detach
op_id, the heartbeat and the lane -- is guarded; ops on the lane are serialised); an asyncio
session belongs to its event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import grpc

from hicached_client import _calls
from hicached_client._calls import Call, new_op_id
from hicached_client._channel import check_metadata
from hicached_client._lane_common import Budget
from hicached_client._sync_backend import Beat, Lock
from hicached_client._sync_lane import LaneSlot, lane_keys
from hicached_client.errors import HiCacheError, beat_interval, heartbeat_failure
from hicached_client.types import (
    AllocResult,
    AttachResult,
    BackupResult,
    GetBytesResult,
    GetPagesResult,
    Keys,
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
    WriteResult,
)

if TYPE_CHECKING:
    from hicached_client.sync import HiCacheClient, LoadStream

T = TypeVar("T")
log = logging.getLogger(__name__)


class Session:
    """A worker session of one daemon (``client.attach``/``client.session``); detaches on ``with`` exit."""

    def __init__(self, client: HiCacheClient, info: AttachResult, *, heartbeat: bool) -> None:
        check_metadata("session_secret", info.session_secret)
        self.client = client
        self.info = info
        self._lock = Lock()
        # Set once a Detach succeeded or found the session gone; a retried close reuses its op_id.
        self._detached = False
        self._detach_op: str | None = None
        self._lease_lost: HiCacheError | None = None
        self.heartbeats = 0
        self._beat: Beat | None = None
        self._slot = LaneSlot(client.fast_lane)
        client._sessions.add(self)
        if heartbeat:
            if info.lease_ms <= 0:
                raise ValueError(f"heartbeat needs lease_ms > 0, got lease_ms={info.lease_ms}")
            name = f"hicached-heartbeat-{info.session_id[:8]}"
            self._beat = Beat(self._beat_once, beat_interval(info.lease_ms), name)

    @property
    def session_id(self) -> str:
        return self.info.session_id

    @property
    def lease_lost(self) -> HiCacheError | None:
        """The heartbeat's fatal error (session unknown / replaced), else ``None``."""
        return self._lease_lost

    @property
    def heartbeat_running(self) -> bool:
        return self._beat is not None and self._beat.running

    def _beat_once(self) -> bool:
        """One heartbeat; False once the lease is lost for good (every failure is logged)."""
        try:
            self.heartbeat(timeout_s=beat_interval(self.info.lease_ms))
        except Exception as exc:
            self._lease_lost = heartbeat_failure(exc, self.session_id)
            return self._lease_lost is None
        return True

    def stop_heartbeat(self) -> None:
        """Stop renewing the lease (the session expires after ``lease_ms``)."""
        if self._beat is not None:
            self._beat.stop()

    def _op(self, op_id: str | None) -> str:
        return op_id or new_op_id()

    def _invoke(self, call: Call[T], timeout_s: float | None) -> T:
        return self.client.invoke(call.signed(self.info.session_secret), timeout_s)

    def _end(self, op_id: str | None) -> str:
        """Stop the heartbeat and close the fast lane (both idempotent); the Detach op_id to send."""
        with self._lock:
            op = self._detach_op = op_id or self._detach_op or new_op_id()
        self.stop_heartbeat()
        self._slot.close()
        return op

    def _budget(self, timeout_s: float | None, rpc: str) -> Budget:
        return Budget(self.client.config.timeout_s if timeout_s is None else timeout_s, rpc)

    # -------------------------------------------------------------- lifecycle

    def detach(self, *, op_id: str | None = None, timeout_s: float | None = None) -> int:
        """End the session; the host pages freed. Again after a failure: the same op_id is re-sent."""
        freed = self._invoke(_calls.detach(self.session_id, self._end(op_id)), timeout_s)
        self._detached = True
        return freed

    def close(self) -> None:
        """Detach unless a Detach succeeded (a failed one is re-sent); a session already gone is fine."""
        if self._detached:
            return
        try:
            self.detach()
        except HiCacheError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            self._detached = True
            log.info("session %s was already gone at close: %s", self.session_id, exc)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def heartbeat(self, *, timeout_s: float | None = None) -> int:
        """Extend the lease; returns its new expiry (unix ms)."""
        expiry = self._invoke(_calls.heartbeat(self.session_id), timeout_s)
        self.heartbeats += 1
        return expiry

    def stats(self, *, timeout_s: float | None = None) -> Stats:
        """The daemon's view of this session."""
        return self._invoke(_calls.get_stats(self.session_id), timeout_s)

    # ------------------------------------------------------------ host pages

    def alloc(
        self, pool: str, num_pages: int, *, op_id: str | None = None, timeout_s: float | None = None
    ) -> AllocResult:
        return self._invoke(_calls.alloc(self.session_id, self._op(op_id), pool, num_pages), timeout_s)

    def free(
        self, pool: str, host_pages: PageIndices, *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        return self._invoke(_calls.free(self.session_id, self._op(op_id), pool, host_pages), timeout_s)

    def resolve_transfers(
        self,
        transfers: Sequence[Transfer],
        *,
        primary_device_pages: PageIndices | None = None,
        primary_host_pages: PageIndices | None = None,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> ResolveResult:
        op, budget = self._op(op_id), self._budget(timeout_s, "ResolveTransfers")
        lane = self._slot.get(self, primary_device_pages is None and primary_host_pages is None, op)
        if lane is not None:
            try:
                return lane.resolve_transfers(transfers, op_id=op, timeout_s=budget.left())
            except HiCacheError as exc:
                self._slot.failed(exc, "ResolveTransfers", self.client.config.retry)
        call = _calls.resolve_transfers(
            self.session_id, op, transfers, primary_device_pages, primary_host_pages
        )
        return self._invoke(call, budget.left())

    def release_transfers(
        self, transfers: Sequence[Transfer], *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        op, budget = self._op(op_id), self._budget(timeout_s, "ReleaseTransfers")
        lane = self._slot.get(self, True, op)
        if lane is not None:
            try:
                return lane.release_transfers(transfers, op_id=op, timeout_s=budget.left())
            except HiCacheError as exc:
                self._slot.failed(exc, "ReleaseTransfers", self.client.config.retry)
        return self._invoke(_calls.release_transfers(self.session_id, op, transfers), budget.left())

    # ------------------------------------------------------------ data plane

    def write(
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
        op, budget = self._op(op_id), self._budget(timeout_s, "Write")
        lane = self._slot.get(
            self, primary_device_pages is None and primary_host_pages is None and ready is None, op
        )
        if lane is not None:
            try:
                return lane.write(transfers, allocate=allocate, op_id=op, timeout_s=budget.left())
            except HiCacheError as exc:
                self._slot.failed(exc, "Write", self.client.config.retry)
        call = _calls.write(
            self.session_id,
            op,
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            primary_host_pages=primary_host_pages,
            allocate=allocate,
            ready=ready,
        )
        return self._invoke(call, budget.left())

    def load(
        self,
        transfers: Sequence[Transfer],
        *,
        layer_progress: bool = True,
        primary_device_pages: PageIndices | None = None,
        primary_host_pages: PageIndices | None = None,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LoadStream:
        """Host -> device copy, layer by layer; iterate the stream for per-layer progress (gRPC)."""
        call = _calls.load(
            self.session_id,
            self._op(op_id),
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            primary_host_pages=primary_host_pages,
            layer_progress=layer_progress,
        )
        return self.client.stream(call.signed(self.info.session_secret), timeout_s)

    def load_wait(
        self,
        transfers: Sequence[Transfer],
        *,
        layer_progress: bool = True,
        primary_device_pages: PageIndices | None = None,
        primary_host_pages: PageIndices | None = None,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LoadResult:
        """:meth:`load` and wait for the end (over the fast lane when the session has one)."""
        op, budget = self._op(op_id), self._budget(timeout_s, "Load")
        lane = self._slot.get(self, primary_device_pages is None and primary_host_pages is None, op)
        if lane is not None:
            try:
                return lane.load(transfers, layer_progress=layer_progress, op_id=op, timeout_s=budget.left())
            except HiCacheError as exc:
                self._slot.failed(exc, "Load", self.client.config.retry)
        stream = self.load(
            transfers,
            layer_progress=layer_progress,
            primary_device_pages=primary_device_pages,
            primary_host_pages=primary_host_pages,
            op_id=op,
            timeout_s=budget.left(),
        )
        return stream.wait()

    # ------------------------------------------------------------ retraction

    def retract_backup(
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
        return self._invoke(call, timeout_s)

    def retract_restore(
        self,
        backup_id: str,
        transfers: Sequence[Transfer],
        *,
        layer_progress: bool = True,
        primary_device_pages: PageIndices | None = None,
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LoadStream:
        call = _calls.retract_restore(
            self.session_id,
            self._op(op_id),
            backup_id=backup_id,
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            layer_progress=layer_progress,
        )
        return self.client.stream(call.signed(self.info.session_secret), timeout_s)

    def retract_restore_wait(
        self, backup_id: str, transfers: Sequence[Transfer], **kwargs: Any
    ) -> LoadResult:
        return self.retract_restore(backup_id, transfers, **kwargs).wait()

    def retract_discard(
        self, backup_id: str, *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        return self._invoke(_calls.retract_discard(self.session_id, self._op(op_id), backup_id), timeout_s)

    # --------------------------------------------------------- content cache

    def lookup(
        self, keys: Keys, *, tenant: str = "", per_key: bool = False, timeout_s: float | None = None
    ) -> LookupResult:
        """Leading cached runs of ``keys``; ``per_key``: each key's flags too (over gRPC)."""
        given, budget = None if per_key else lane_keys(keys, tenant), self._budget(timeout_s, "Lookup")
        lane = self._slot.get(self, given is not None)
        if lane is not None and given is not None:
            try:
                return lane.lookup(given, timeout_s=budget.left())
            except HiCacheError as exc:
                self._slot.failed(exc, "Lookup", self.client.config.retry)
        return self._invoke(_calls.lookup(self.session_id, given or keys, tenant, per_key), budget.left())

    def publish(
        self,
        keys: Keys,
        transfers: Sequence[Transfer],
        *,
        tenant: str = "",
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PublishResult:
        call = _calls.publish(self.session_id, self._op(op_id), keys, transfers, tenant)
        return self._invoke(call, timeout_s)

    def put_pages(
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
        op, budget = self._op(op_id), self._budget(timeout_s, "PutPages")
        given = lane_keys(keys, tenant)
        plain = primary_device_pages is None and ready is None  # the lane carries neither
        lane = self._slot.get(self, given is not None and plain, op)
        if lane is not None and given is not None:
            try:
                return lane.put_pages(given, transfers, op_id=op, timeout_s=budget.left())
            except HiCacheError as exc:
                self._slot.failed(exc, "PutPages", self.client.config.retry)
        call = _calls.put_pages(
            self.session_id,
            op,
            keys=given or keys,  # ``keys`` may be an iterator lane_keys has read
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            ready=ready,
            tenant=tenant,
        )
        return self._invoke(call, budget.left())

    def get_pages(
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
        op, budget = self._op(op_id), self._budget(timeout_s, "GetPages")
        given = lane_keys(keys, tenant)
        lane = self._slot.get(self, given is not None and primary_device_pages is None, op)
        if lane is not None and given is not None:
            try:
                return lane.get_pages(
                    given, transfers, include_l3=include_l3, op_id=op, timeout_s=budget.left()
                )
            except HiCacheError as exc:
                self._slot.failed(exc, "GetPages", self.client.config.retry)
        call = _calls.get_pages(
            self.session_id,
            op,
            keys=given or keys,  # ``keys`` may be an iterator lane_keys has read
            transfers=transfers,
            primary_device_pages=primary_device_pages,
            include_l3=include_l3,
            tenant=tenant,
        )
        return self._invoke(call, budget.left())

    def prefetch(
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
        return self._invoke(call, timeout_s)

    def prefetch_status(
        self, prefetch_id: str, *, wait: bool = False, timeout_s: float | None = None
    ) -> PrefetchStatus:
        return self._invoke(_calls.prefetch_status(self.session_id, prefetch_id, wait), timeout_s)

    def cancel_prefetch(
        self, prefetch_id: str, *, op_id: str | None = None, timeout_s: float | None = None
    ) -> int:
        call = _calls.cancel_prefetch(self.session_id, self._op(op_id), prefetch_id)
        return self._invoke(call, timeout_s)

    def backup(
        self,
        keys: Keys,
        *,
        wait: bool = False,
        tenant: str = "",
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> BackupResult:
        """Queue an L2 -> L3 backup of cached keys; with ``wait``, return once stored (``shortfall``: why not all)."""
        return self._invoke(_calls.backup(self.session_id, self._op(op_id), keys, tenant, wait), timeout_s)

    def put_bytes(
        self,
        pages: Sequence[PageBytes],
        *,
        tenant: str = "",
        op_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PutBytesResult:
        return self._invoke(_calls.put_bytes(self.session_id, self._op(op_id), pages, tenant), timeout_s)

    def get_bytes(
        self, keys: Keys, *, include_l3: bool = False, tenant: str = "", timeout_s: float | None = None
    ) -> GetBytesResult:
        return self._invoke(_calls.get_bytes(self.session_id, keys, include_l3, tenant), timeout_s)
