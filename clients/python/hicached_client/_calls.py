"""Request builders shared by the sync and the asyncio client.

Each function turns typed arguments into a :class:`Call`: the RPC to invoke,
the request message (with the caller's ``op_id`` baked in, so that a retry
re-sends the very same request) and the converter of the response. Building a
call does no I/O; invoking it is the client's job.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from hicached_client import _convert as cv
from hicached_client._channel import check_metadata
from hicached_client._handoff import SESSION_SECRET_METADATA
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
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

T = TypeVar("T")


def new_op_id() -> str:
    """A fresh operation id (uuid4 hex): unique per session, reused by retries."""
    return uuid.uuid4().hex


class Service(Enum):
    HICACHE = "HiCacheService"
    ADMIN = "AdminService"


class Line(Enum):
    """Which of the client's connections a call takes.

    A connection carries at most the daemon's ``server.max_streams_per_connection`` calls at
    once (64) and queues the rest in the client, so a heartbeat sent beside many slow data calls
    (a hung L3) would wait behind them until its lease ran out; heartbeats have their own.
    """

    DATA = "data"
    HEARTBEAT = "heartbeat"


@dataclass(frozen=True)
class Call(Generic[T]):
    """One RPC ready to send: ``method`` of ``service`` with ``request``; ``convert`` maps the reply."""

    method: str
    request: Message
    convert: Callable[[Any], T]
    service: Service = Service.HICACHE
    line: Line = Line.DATA
    # Call-specific metadata (the session secret), sent after the channel's own.
    metadata: tuple[tuple[str, str], ...] = ()

    def signed(self, session_secret: str) -> Call[T]:
        """This call carrying a session's capability (unchanged when the secret is empty)."""
        check_metadata("session_secret", session_secret)
        if not session_secret:
            return self
        return replace(self, metadata=(*self.metadata, (SESSION_SECRET_METADATA, session_secret)))


# ---------------------------------------------------------------- sessions


def attach(
    op_id: str,
    identity: WorkerIdentity,
    pools: Sequence[tpb.PoolSpec],
    lease_ms: int,
    handoff_ticket: str = "",
    join_only: bool = False,
) -> Call[AttachResult]:
    req = cv.message(
        pb.AttachRequest,
        op_id=op_id,
        identity=cv.identity_to_wire(identity),
        pools=list(pools),
        lease_ms=lease_ms,
        handoff_ticket=handoff_ticket,
        join_only=join_only,
    )
    return Call("Attach", req, cv.attach_result)


def detach(session_id: str, op_id: str) -> Call[int]:
    return Call("Detach", pb.DetachRequest(session_id=session_id, op_id=op_id), cv.freed_pages)


def _lease_expiry(msg: pb.HeartbeatResponse) -> int:
    return msg.lease_expires_unix_ms


def heartbeat(session_id: str) -> Call[int]:
    return Call("Heartbeat", pb.HeartbeatRequest(session_id=session_id), _lease_expiry, line=Line.HEARTBEAT)


# -------------------------------------------------------------- host pages


def alloc(session_id: str, op_id: str, pool: str, num_pages: int) -> Call[AllocResult]:
    req = cv.message(pb.AllocRequest, session_id=session_id, op_id=op_id, pool=pool, num_pages=num_pages)
    return Call("Alloc", req, cv.alloc_result)


def free(session_id: str, op_id: str, pool: str, host_pages: PageIndices) -> Call[int]:
    req = pb.FreeRequest(
        session_id=session_id, op_id=op_id, pool=pool, host_pages=cv.indices(host_pages, "host_pages")
    )
    return Call("Free", req, cv.freed_pages)


def resolve_transfers(
    session_id: str,
    op_id: str,
    transfers: Sequence[Transfer],
    primary_device_pages: PageIndices | None,
    primary_host_pages: PageIndices | None,
) -> Call[ResolveResult]:
    batch = cv.batch_to_wire(transfers, primary_device_pages, primary_host_pages)
    req = pb.ResolveTransfersRequest(session_id=session_id, op_id=op_id, batch=batch)
    return Call("ResolveTransfers", req, cv.resolve_result)


def release_transfers(session_id: str, op_id: str, transfers: Sequence[Transfer]) -> Call[int]:
    wire = list(cv.batch_to_wire(transfers).transfers)
    req = pb.ReleaseTransfersRequest(session_id=session_id, op_id=op_id, transfers=wire)
    return Call("ReleaseTransfers", req, cv.freed_pages)


# -------------------------------------------------------------- data plane


def write(
    session_id: str,
    op_id: str,
    *,
    transfers: Sequence[Transfer],
    primary_device_pages: PageIndices | None,
    primary_host_pages: PageIndices | None,
    allocate: bool,
    ready: bytes | None,
) -> Call[WriteResult]:
    req = pb.WriteRequest(
        session_id=session_id,
        op_id=op_id,
        batch=cv.batch_to_wire(transfers, primary_device_pages, primary_host_pages),
        allocate=allocate,
        ready=cv.fence_to_wire(ready),
    )
    return Call("Write", req, cv.write_result)


def load(
    session_id: str,
    op_id: str,
    *,
    transfers: Sequence[Transfer],
    primary_device_pages: PageIndices | None,
    primary_host_pages: PageIndices | None,
    layer_progress: bool,
) -> Call[LoadProgress]:
    req = pb.LoadRequest(
        session_id=session_id,
        op_id=op_id,
        batch=cv.batch_to_wire(transfers, primary_device_pages, primary_host_pages),
        layer_progress=layer_progress,
    )
    return Call("Load", req, cv.load_progress)


# -------------------------------------------------------------- retraction


def retract_backup(
    session_id: str,
    op_id: str,
    *,
    request_id: str,
    transfers: Sequence[Transfer],
    num_tokens: int,
    lease_ms: int,
    ready: bytes | None,
    primary_device_pages: PageIndices | None,
) -> Call[RetractBackupResult]:
    req = pb.RetractBackupRequest(
        session_id=session_id,
        op_id=op_id,
        request_id=request_id,
        batch=cv.batch_to_wire(transfers, primary_device_pages),
        num_tokens=num_tokens,
        lease_ms=lease_ms,
        ready=cv.fence_to_wire(ready),
    )
    return Call("RetractBackup", req, cv.retract_backup_result)


def retract_restore(
    session_id: str,
    op_id: str,
    *,
    backup_id: str,
    transfers: Sequence[Transfer],
    primary_device_pages: PageIndices | None,
    layer_progress: bool,
) -> Call[LoadProgress]:
    req = pb.RetractRestoreRequest(
        session_id=session_id,
        op_id=op_id,
        backup_id=backup_id,
        batch=cv.batch_to_wire(transfers, primary_device_pages),
        layer_progress=layer_progress,
    )
    return Call("RetractRestore", req, cv.load_progress)


def retract_discard(session_id: str, op_id: str, backup_id: str) -> Call[int]:
    req = pb.RetractDiscardRequest(session_id=session_id, op_id=op_id, backup_id=backup_id)
    return Call("RetractDiscard", req, cv.freed_pages)


# ----------------------------------------------------------- content cache


def lookup(session_id: str, keys: Keys, tenant: str, per_key: bool = False) -> Call[LookupResult]:
    req = pb.LookupRequest(session_id=session_id, keys=cv.keys_to_wire(keys, tenant), per_key=per_key)
    return Call("Lookup", req, lambda msg: cv.lookup_result(msg, req.keys, per_key))


def publish(
    session_id: str, op_id: str, keys: Keys, transfers: Sequence[Transfer], tenant: str
) -> Call[PublishResult]:
    req = pb.PublishRequest(
        session_id=session_id,
        op_id=op_id,
        keys=cv.keys_to_wire(keys, tenant),
        transfers=list(cv.batch_to_wire(transfers).transfers),
    )
    return Call("Publish", req, cv.publish_result)


def put_pages(
    session_id: str,
    op_id: str,
    *,
    keys: Keys,
    transfers: Sequence[Transfer],
    primary_device_pages: PageIndices | None,
    ready: bytes | None,
    tenant: str,
) -> Call[PutPagesResult]:
    req = pb.PutPagesRequest(
        session_id=session_id,
        op_id=op_id,
        keys=cv.keys_to_wire(keys, tenant),
        batch=cv.batch_to_wire(transfers, primary_device_pages),
        ready=cv.fence_to_wire(ready),
    )
    return Call("PutPages", req, cv.put_pages_result)


def get_pages(
    session_id: str,
    op_id: str,
    *,
    keys: Keys,
    transfers: Sequence[Transfer],
    primary_device_pages: PageIndices | None,
    include_l3: bool,
    tenant: str,
) -> Call[GetPagesResult]:
    req = pb.GetPagesRequest(
        session_id=session_id,
        op_id=op_id,
        keys=cv.keys_to_wire(keys, tenant),
        batch=cv.batch_to_wire(transfers, primary_device_pages),
        include_l3=include_l3,
    )
    return Call("GetPages", req, cv.get_pages_result)


def prefetch(
    session_id: str, op_id: str, *, keys: Keys, policy: PrefetchPolicy | str, timeout_ms: int, tenant: str
) -> Call[PrefetchTicket]:
    req = cv.message(
        pb.PrefetchRequest,
        session_id=session_id,
        op_id=op_id,
        keys=cv.keys_to_wire(keys, tenant),
        policy=cv.enum_to_wire(cv.PREFETCH_POLICIES, PrefetchPolicy, policy),  # type: ignore[arg-type]
        timeout_ms=timeout_ms,
    )
    return Call("Prefetch", req, cv.prefetch_ticket)


def prefetch_status(session_id: str, prefetch_id: str, wait: bool) -> Call[PrefetchStatus]:
    req = pb.PrefetchStatusRequest(session_id=session_id, prefetch_id=prefetch_id, wait=wait)
    return Call("PrefetchStatus", req, cv.prefetch_status)


def _completed_pages(msg: pb.CancelPrefetchResponse) -> int:
    return msg.completed_pages


def cancel_prefetch(session_id: str, op_id: str, prefetch_id: str) -> Call[int]:
    req = pb.CancelPrefetchRequest(session_id=session_id, op_id=op_id, prefetch_id=prefetch_id)
    return Call("CancelPrefetch", req, _completed_pages)


def backup(session_id: str, op_id: str, keys: Keys, tenant: str, wait: bool) -> Call[BackupResult]:
    req = pb.BackupRequest(session_id=session_id, op_id=op_id, keys=cv.keys_to_wire(keys, tenant), wait=wait)
    return Call("Backup", req, cv.backup_result)


def put_bytes(
    session_id: str, op_id: str, pages: Sequence[PageBytes], tenant: str = ""
) -> Call[PutBytesResult]:
    req = pb.PutBytesRequest(
        session_id=session_id, op_id=op_id, pages=cv.page_bytes_to_wire(pages), tenant=tenant
    )
    return Call("PutBytes", req, cv.put_bytes_result)


def get_bytes(session_id: str, keys: Keys, include_l3: bool, tenant: str) -> Call[GetBytesResult]:
    req = pb.GetBytesRequest(session_id=session_id, keys=cv.keys_to_wire(keys, tenant), include_l3=include_l3)
    return Call("GetBytes", req, cv.get_bytes_result)


# ------------------------------------------------------ observability, admin


def get_stats(session_id: str) -> Call[Stats]:
    return Call("GetStats", pb.GetStatsRequest(session_id=session_id), cv.stats)


def _payload(msg: pb.PingResponse) -> bytes:
    return msg.payload


def ping(payload: bytes) -> Call[bytes]:
    return Call("Ping", pb.PingRequest(payload=payload), _payload)


def drain(wait_flush: bool) -> Call[DrainResult]:
    return Call("Drain", pb.DrainRequest(wait_flush=wait_flush), cv.drain_result, Service.ADMIN)


def resume() -> Call[bool]:
    return Call("Resume", pb.ResumeRequest(), cv.was_draining, Service.ADMIN)


def clear_namespace(model_name: str, tenant: str, session_id: str = "") -> Call[ClearNamespaceResult]:
    req = pb.ClearNamespaceRequest(model_name=model_name, tenant=tenant, session_id=session_id)
    return Call("ClearNamespace", req, cv.clear_namespace_result, Service.ADMIN)
