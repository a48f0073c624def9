"""The one place where client dataclasses and ``hicached.v1`` messages meet.

Pure functions, no I/O; thread-safe. Inputs are copied into fresh messages
(the caller keeps ownership of its arrays); outputs are fresh tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from hicached_client import vocab
from hicached_client.errors import malformed_answer
from hicached_client.types import (
    AllocResult,
    AttachResult,
    BackendInfo,
    BackupResult,
    ClearNamespaceResult,
    DrainResult,
    GetBytesResult,
    GetPagesResult,
    GroupInfo,
    Keys,
    LoadProgress,
    LookupResult,
    PageBytes,
    PageIndices,
    PoolAck,
    PoolInfo,
    PrefetchPolicy,
    PrefetchState,
    PrefetchStatus,
    PrefetchTicket,
    PublishResult,
    PutBytesResult,
    PutPagesResult,
    ResolveResult,
    RetractBackupResult,
    RetractionInfo,
    SessionInfo,
    SessionPool,
    Stats,
    TokenChain,
    Transfer,
    WorkerIdentity,
    WriteResult,
)
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

E = TypeVar("E")
M = TypeVar("M")

# Re-exported for specs.py and the tests (one table each, defined in vocab).
DATA_TYPES = vocab.DATA_TYPES
POOL_KINDS = vocab.POOL_KINDS
POOL_ROLES = vocab.POOL_ROLES
HOST_LAYOUTS = vocab.HOST_LAYOUTS

# Registries: client enum <-> wire enum. One table per enum, used both ways.
PREFETCH_POLICIES: Mapping[PrefetchPolicy, int] = {
    PrefetchPolicy.UNSPECIFIED: pb.PREFETCH_POLICY_UNSPECIFIED,
    PrefetchPolicy.BEST_EFFORT: pb.PREFETCH_POLICY_BEST_EFFORT,
    PrefetchPolicy.WAIT_COMPLETE: pb.PREFETCH_POLICY_WAIT_COMPLETE,
    PrefetchPolicy.TIMEOUT: pb.PREFETCH_POLICY_TIMEOUT,
}
PREFETCH_STATES: Mapping[PrefetchState, int] = {
    PrefetchState.UNSPECIFIED: pb.PREFETCH_STATE_UNSPECIFIED,
    PrefetchState.RUNNING: pb.PREFETCH_STATE_RUNNING,
    PrefetchState.DONE: pb.PREFETCH_STATE_DONE,
    PrefetchState.CANCELLED: pb.PREFETCH_STATE_CANCELLED,
    PrefetchState.TIMED_OUT: pb.PREFETCH_STATE_TIMED_OUT,
    PrefetchState.FAILED: pb.PREFETCH_STATE_FAILED,
}


def enum_to_wire(table: Mapping[E, int], enum_type: type[E], value: E | str) -> int:
    """``value`` (enum member or its string, any case) -> wire number; ``ValueError`` names it."""
    try:
        member = enum_type(value.lower() if isinstance(value, str) else value)  # type: ignore[call-arg]
    except ValueError:
        allowed = ", ".join(str(m) for m in table)
        raise ValueError(f"unknown {enum_type.__name__} {value!r}; expected one of: {allowed}") from None
    return table[member]


def enum_from_wire(table: Mapping[E, int], number: int) -> E | None:
    """Wire number -> enum member; ``None`` for UNSPECIFIED or a value newer than this client."""
    for member, wire in table.items():
        if wire == number:
            return member
    return None


# ------------------------------------------------------------------- inputs


def indices(values: PageIndices, what: str = "page indices") -> list[int]:
    """A fresh ``list[int]`` from a sequence or a 1-D integer array."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be integers, got {type(values).__name__} {values!r:.40}")
    ndim = getattr(values, "ndim", None)
    if ndim is not None and ndim != 1:
        raise ValueError(f"{what} must be 1-D, got an array with ndim={ndim}")
    tolist = getattr(values, "tolist", None)
    out = tolist() if callable(tolist) else list(values)  # type: ignore[arg-type]
    if not isinstance(out, list):
        raise TypeError(f"{what} must be a sequence or a 1-D array, got {type(values).__name__}")
    return out


def transfer_to_wire(transfer: Transfer) -> tpb.PoolTransfer:
    msg = tpb.PoolTransfer(pool=transfer.pool, host_allocated=transfer.host_allocated)
    msg.device_pages.extend(indices(transfer.device_pages, f"device_pages of pool {transfer.pool!r}"))
    if transfer.host_pages is not None:
        msg.host_pages.extend(indices(transfer.host_pages, f"host_pages of pool {transfer.pool!r}"))
    return msg


def batch_to_wire(
    transfers: Iterable[Transfer],
    primary_device_pages: PageIndices | None = None,
    primary_host_pages: PageIndices | None = None,
) -> tpb.TransferBatch:
    if isinstance(transfers, Transfer):
        raise TypeError("transfers must be a sequence of Transfer, got a single Transfer")
    msg = tpb.TransferBatch(transfers=[transfer_to_wire(t) for t in transfers])
    if primary_device_pages is not None:
        msg.primary_device_pages.extend(indices(primary_device_pages, "primary_device_pages"))
    if primary_host_pages is not None:
        msg.primary_host_pages.extend(indices(primary_host_pages, "primary_host_pages"))
    return msg


def keys_to_wire(keys: Keys, tenant: str = "") -> tpb.KeySource:
    if isinstance(keys, TokenChain):
        chain = tpb.TokenChain(
            token_ids=indices(keys.token_ids, "token_ids"),
            include_partial_page=keys.include_partial_page,
        )
        if keys.extra_key is not None:
            chain.extra_key = keys.extra_key
        if keys.cache_salt is not None:
            chain.cache_salt = keys.cache_salt
        return tpb.KeySource(tokens=chain, tenant=tenant)
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"keys must be a sequence of hex strings or a TokenChain, got {keys!r:.40}")
    return tpb.KeySource(keys=tpb.PageKeys(keys=list(keys)), tenant=tenant)


def message(cls: Callable[..., M], **fields: Any) -> M:
    """``cls(**fields)``; a field protobuf refuses (a negative count, a float for an integer)
    is named in the error, as the client's own checks name their argument."""
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, UnicodeError):  # names its string already; takes no message alone
            raise
        for name, value in fields.items():
            try:
                cls(**{name: value})
            except (TypeError, ValueError):
                raise type(exc)(f"{name} = {value!r:.40}: {exc}") from None
        raise


def identity_to_wire(identity: WorkerIdentity) -> tpb.WorkerIdentity:
    return message(
        tpb.WorkerIdentity,
        instance_id=identity.instance_id,
        generation=identity.generation,
        model_name=identity.model_name,
        tp_rank=identity.tp_rank,
        tp_size=identity.tp_size,
        pp_rank=identity.pp_rank,
        pp_size=identity.pp_size,
        tenant=identity.tenant,
    )


def fence_to_wire(ready: bytes | None) -> tpb.Fence | None:
    return None if ready is None else tpb.Fence(cuda_ipc_event=ready)


def page_bytes_to_wire(pages: Sequence[PageBytes]) -> list[tpb.PageBytes]:
    return [tpb.PageBytes(key=p.key, pool=p.pool, data=p.data) for p in pages]


# ------------------------------------------------------------------ outputs


def ack(msg: tpb.PoolAck) -> PoolAck:
    return PoolAck(pool=msg.pool, pages=msg.pages, tokens=msg.tokens, bytes=msg.bytes)


def acks(msgs: Iterable[tpb.PoolAck]) -> tuple[PoolAck, ...]:
    return tuple(ack(m) for m in msgs)


def transfer(msg: tpb.PoolTransfer) -> Transfer:
    return Transfer(
        pool=msg.pool,
        device_pages=tuple(msg.device_pages),
        host_pages=tuple(msg.host_pages),
        host_allocated=msg.host_allocated,
    )


def pool_info(msg: tpb.PoolInfo) -> PoolInfo:
    return PoolInfo(
        name=msg.name,
        role=enum_from_wire(POOL_ROLES, msg.role),
        host_layout=enum_from_wire(HOST_LAYOUTS, msg.host_layout),
        page_size=msg.page_size,
        total_pages=msg.total_pages,
        free_pages=msg.free_pages,
        page_bytes=msg.page_bytes,
        segment=msg.segment,
    )


def identity(msg: tpb.WorkerIdentity) -> WorkerIdentity:
    return WorkerIdentity(
        instance_id=msg.instance_id,
        generation=msg.generation,
        model_name=msg.model_name,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size,
        pp_rank=msg.pp_rank,
        pp_size=msg.pp_size,
        tenant=msg.tenant,
    )


def attach_result(msg: pb.AttachResponse) -> AttachResult:
    return AttachResult(
        session_id=msg.session_id,
        lease_ms=msg.lease_ms,
        pools=tuple(pool_info(p) for p in msg.pools),
        joined_existing_group=msg.joined_existing_group,
        replaced_session_id=msg.replaced_session_id,
        session_secret=msg.session_secret,
        group=msg.group,
    )


def alloc_result(msg: pb.AllocResponse) -> AllocResult:
    return AllocResult(ok=msg.ok, host_pages=tuple(msg.host_pages))


def resolve_result(msg: pb.ResolveTransfersResponse) -> ResolveResult:
    return ResolveResult(
        ok=msg.ok,
        transfers=tuple(transfer(t) for t in msg.batch.transfers),
        primary_device_pages=tuple(msg.batch.primary_device_pages),
        primary_host_pages=tuple(msg.batch.primary_host_pages),
    )


def write_result(msg: pb.WriteResponse) -> WriteResult:
    return WriteResult(
        ok=msg.ok,
        transfers=tuple(transfer(t) for t in msg.batch.transfers),
        acks=acks(msg.acks),
        primary_host_pages=tuple(msg.batch.primary_host_pages),
    )


def load_progress(msg: pb.LoadProgress) -> LoadProgress:
    return LoadProgress(layer=msg.layer, done=msg.done, acks=acks(msg.acks))


def retract_backup_result(msg: pb.RetractBackupResponse) -> RetractBackupResult:
    return RetractBackupResult(
        ok=msg.ok,
        backup_id=msg.backup_id,
        lease_expires_unix_ms=msg.lease_expires_unix_ms,
        acks=acks(msg.acks),
    )


def lookup_result(msg: pb.LookupResponse, sent: tpb.KeySource, per_key: bool = False) -> LookupResult:
    """The answer to the request that carried ``sent`` (its keys as sent, not the caller's
    objects, which may have changed since). The daemon sends back only the keys it derived
    from tokens; given keys are the ones sent.

    ``HiCacheError(INTERNAL)`` for an answer that does not fit the question: per-key flags
    other than one per key (none without ``per_key``: the SGLang adapter read a short list's
    missing flags as hits), a hit run longer than the keys (given or derived), or more derived
    keys than the chain has tokens."""
    chain = sent.WhichOneof("source") == "tokens"
    keys = tuple(msg.keys) if chain else tuple(sent.keys.keys)
    flags = len(keys) if per_key else 0
    if len(msg.in_l2) != flags or len(msg.cached) != flags:
        raise malformed_answer(
            "Lookup", f"{len(msg.in_l2)} in_l2 and {len(msg.cached)} cached flags for {flags} keys"
        )
    if chain and len(keys) > len(sent.tokens.token_ids):  # a derived key covers a token at least
        raise malformed_answer("Lookup", f"{len(keys)} keys for {len(sent.tokens.token_ids)} tokens")
    check_hit_run("Lookup", max(msg.l2_hit_pages, msg.total_hit_pages), len(keys))
    return LookupResult(
        keys=keys,
        l2_hit_pages=msg.l2_hit_pages,
        total_hit_pages=msg.total_hit_pages,
        in_l2=tuple(msg.in_l2),
        cached=tuple(msg.cached),
    )


def check_hit_run(method: str, hits: int, keys: int) -> None:
    """``HiCacheError(INTERNAL)`` when an answer counts more leading hits than the keys asked."""
    if hits > keys:
        raise malformed_answer(method, f"a hit run of {hits} pages for {keys} keys")


def publish_result(msg: pb.PublishResponse) -> PublishResult:
    return PublishResult(published_pages=msg.published_pages, existing_pages=msg.existing_pages)


def put_pages_result(msg: pb.PutPagesResponse) -> PutPagesResult:
    return PutPagesResult(
        ok=msg.ok,
        stored_pages=msg.stored_pages,
        existing_pages=msg.existing_pages,
        acks=acks(msg.acks),
        reason=msg.reason,
    )


def get_pages_result(msg: pb.GetPagesResponse) -> GetPagesResult:
    return GetPagesResult(hit_pages=msg.hit_pages, acks=acks(msg.acks))


def prefetch_ticket(msg: pb.PrefetchResponse) -> PrefetchTicket:
    return PrefetchTicket(prefetch_id=msg.prefetch_id, planned_pages=msg.planned_pages)


def prefetch_status(msg: pb.PrefetchStatusResponse) -> PrefetchStatus:
    state = enum_from_wire(PREFETCH_STATES, msg.state) or PrefetchState.UNSPECIFIED
    return PrefetchStatus(state=state, completed_pages=msg.completed_pages, planned_pages=msg.planned_pages)


def backup_result(msg: pb.BackupResponse) -> BackupResult:
    return BackupResult(queued_pages=msg.queued_pages, stored_pages=msg.stored_pages, shortfall=msg.shortfall)


def put_bytes_result(msg: pb.PutBytesResponse) -> PutBytesResult:
    return PutBytesResult(stored_pages=msg.stored_pages, existing_pages=msg.existing_pages)


def get_bytes_result(msg: pb.GetBytesResponse) -> GetBytesResult:
    pages = tuple(PageBytes(key=p.key, pool=p.pool, data=bytes(p.data)) for p in msg.pages)
    return GetBytesResult(pages=pages, hit_pages=msg.hit_pages)


def stats(msg: pb.GetStatsResponse) -> Stats:
    return Stats(
        sessions=tuple(
            SessionInfo(
                session_id=s.session_id,
                identity=identity(s.identity),
                group=s.group,
                owned_pages=s.owned_pages,
                lease_expires_unix_ms=s.lease_expires_unix_ms,
                pools=tuple(SessionPool(p.name, p.buffers, p.data_path) for p in s.pools),
            )
            for s in msg.sessions
        ),
        groups=tuple(
            GroupInfo(
                group=g.group,
                model_name=g.model_name,
                pools=tuple(pool_info(p) for p in g.pools),
                indexed_pages=g.indexed_pages,
                sessions=g.sessions,
                holds=g.holds,
            )
            for g in msg.groups
        ),
        backups=tuple(
            RetractionInfo(
                backup_id=b.backup_id,
                session_id=b.session_id,
                request_id=b.request_id,
                pages=b.pages,
                lease_expires_unix_ms=b.lease_expires_unix_ms,
            )
            for b in msg.backups
        ),
        backends=tuple(
            BackendInfo(
                name=b.name,
                pages=b.pages,
                bytes=b.bytes,
                capacity_bytes=b.capacity_bytes,
                hits=b.hits,
                misses=b.misses,
                corrupt_pages=b.corrupt_pages,
                age_ms=b.age_ms,
                error=b.error,
            )
            for b in msg.backends
        ),
        host_budget_bytes=msg.host_budget_bytes,
        host_used_bytes=msg.host_used_bytes,
        draining=msg.draining,
        version=msg.version,
    )


def drain_result(msg: pb.DrainResponse) -> DrainResult:
    return DrainResult(flushed_pages=msg.flushed_pages)


def was_draining(msg: pb.ResumeResponse) -> bool:
    return bool(msg.was_draining)


def clear_namespace_result(msg: pb.ClearNamespaceResponse) -> ClearNamespaceResult:
    return ClearNamespaceResult(l2_pages=msg.l2_pages, l3_pages=msg.l3_pages)


def freed_pages(msg: Any) -> int:
    """``freed_pages`` of Detach / Free / ReleaseTransfers / RetractDiscard responses."""
    return int(msg.freed_pages)
