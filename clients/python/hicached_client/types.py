"""Typed inputs and results of the client (plain Python; no protobuf in sight).

Every result is a frozen dataclass built from the daemon's response in
``hicached_client._convert``; callers never handle generated protobuf
messages except for ``PoolSpec`` / ``DeviceBuffer`` (built by
``hicached_client.specs.pool_spec`` and ``hicached_client.export``).

Page indices are PAGE indices (not token slots). Inputs accept any sequence of
ints or any 1-D array object with ``tolist()`` (numpy int64 arrays, torch
tensors); outputs are tuples, so results are hashable and cannot alias a
caller's buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypeAlias, runtime_checkable

from hicached_client import vocab

# The wire vocabulary lives in hicached_client.vocab (shared with the daemon); these names stay here.
PoolRole = vocab.PoolRole
PoolKind = vocab.PoolKind
HostLayout = vocab.HostLayout
DataType = vocab.DataType
PrefetchState = vocab.PrefetchState

# ------------------------------------------------------------------- inputs


@runtime_checkable
class ArrayLike(Protocol):
    """A 1-D integer array (numpy ``ndarray``, torch ``Tensor``): anything with ``tolist()``."""

    def tolist(self) -> Any: ...


PageIndices: TypeAlias = Sequence[int] | ArrayLike
"""Page indices as a list/tuple/range of ints or a 1-D integer array."""


class PrefetchPolicy(StrEnum):
    """When a prefetch stops waiting for L3 (SGLang names)."""

    UNSPECIFIED = "unspecified"
    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class WorkerIdentity:
    """Who a worker is; ``(instance_id, tp_rank, pp_rank)`` names a worker slot.

    A higher ``generation`` replaces the slot's session; a lower one is refused.
    """

    instance_id: str
    generation: int = 0
    model_name: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    #: The session's tenant, fixed at attach: its keyed calls see only this tenant's pages.
    tenant: str = ""


@dataclass(frozen=True)
class Transfer:
    """Pages of one pool moved by a request; ``device_pages[i]`` pairs with ``host_pages[i]``.

    On input, ``host_pages=None`` means "allocate for me" (resolve / write with
    ``allocate=True``). On output the pages are tuples and ``host_allocated``
    says whether the request allocated them (so releasing the transfer frees them).
    """

    pool: str
    device_pages: PageIndices
    host_pages: PageIndices | None = None
    host_allocated: bool = False


@dataclass(frozen=True)
class TokenChain:
    """Token ids the daemon hashes into chained page keys (SGLang scheme)."""

    token_ids: PageIndices
    extra_key: str | None = None
    cache_salt: str | None = None
    include_partial_page: bool = False


Keys: TypeAlias = Sequence[str] | TokenChain
"""Page keys: hex SHA-256 strings in prefix order, or token ids to derive them from."""


@dataclass(frozen=True)
class PageBytes:
    """Raw bytes of one (key, pool) page for the byte-transport fallback."""

    key: str
    pool: str
    data: bytes


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class PoolInfo:
    """Host state of one pool (``free_pages`` is a snapshot taken by the daemon)."""

    name: str
    role: PoolRole | None
    host_layout: HostLayout | None
    page_size: int
    total_pages: int
    free_pages: int
    page_bytes: int
    segment: str


@dataclass(frozen=True)
class AttachResult:
    """The daemon's answer to an attach."""

    session_id: str
    lease_ms: int
    pools: tuple[PoolInfo, ...]
    joined_existing_group: bool
    replaced_session_id: str
    # The session's capability, sent as metadata on every call of the session (never logged).
    session_secret: str = field(default="", repr=False)
    # The pool group the session joined or created (``GroupInfo.group``); "" from an older
    # daemon, and in a handle made by ``client.session``.
    group: str = ""

    def pool(self, name: str) -> PoolInfo:
        """The pool called ``name``; ``KeyError`` naming it when absent."""
        for info in self.pools:
            if info.name == name:
                return info
        raise KeyError(f"no pool {name!r} in attach result (pools: {[p.name for p in self.pools]})")


@dataclass(frozen=True)
class PoolAck:
    """Bytes and tokens moved for one pool."""

    pool: str
    pages: int
    tokens: int
    bytes: int


@dataclass(frozen=True)
class AllocResult:
    """``ok=False`` means no host room (nothing allocated)."""

    ok: bool
    host_pages: tuple[int, ...]


@dataclass(frozen=True)
class ResolveResult:
    """Outcome of a resolve: ``ok=False`` means no host room and nothing allocated."""

    ok: bool
    transfers: tuple[Transfer, ...]
    primary_device_pages: tuple[int, ...] = ()
    primary_host_pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class WriteResult:
    """Outcome of a device-to-host write; ``transfers`` carry the host pages used."""

    ok: bool
    transfers: tuple[Transfer, ...]
    acks: tuple[PoolAck, ...]
    primary_host_pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadProgress:
    """One message of a load stream: ``layer`` is complete on the device."""

    layer: int
    done: bool
    acks: tuple[PoolAck, ...] = ()


@dataclass(frozen=True)
class LoadResult:
    """A finished load: the layers reported in order and the final acks."""

    layers: tuple[int, ...]
    acks: tuple[PoolAck, ...]


@dataclass(frozen=True)
class RetractBackupResult:
    """``ok=False``: declined for lack of host room, nothing allocated."""

    ok: bool
    backup_id: str
    lease_expires_unix_ms: int
    acks: tuple[PoolAck, ...]


@dataclass(frozen=True)
class LookupResult:
    keys: tuple[str, ...]
    l2_hit_pages: int
    total_hit_pages: int
    # Per key, from a ``per_key`` lookup only (empty otherwise): resident in L2; in L2 or L3.
    in_l2: tuple[bool, ...] = ()
    cached: tuple[bool, ...] = ()


@dataclass(frozen=True)
class PublishResult:
    published_pages: int
    existing_pages: int


@dataclass(frozen=True)
class PutPagesResult:
    ok: bool
    stored_pages: int
    existing_pages: int
    acks: tuple[PoolAck, ...]
    # With ok False: the daemon's reason for refusing (no room, over budget, ...).
    reason: str = ""


@dataclass(frozen=True)
class GetPagesResult:
    hit_pages: int
    acks: tuple[PoolAck, ...]


@dataclass(frozen=True)
class PrefetchTicket:
    prefetch_id: str
    planned_pages: int


@dataclass(frozen=True)
class PrefetchStatus:
    state: PrefetchState
    completed_pages: int
    planned_pages: int


@dataclass(frozen=True)
class BackupResult:
    """``queued_pages``: cached in L2, not yet in L3; ``stored_pages``: stored (only with ``wait``);
    ``shortfall``: with ``wait``, why fewer were stored than queued, for a person ("" otherwise)."""

    queued_pages: int
    stored_pages: int
    shortfall: str = ""


@dataclass(frozen=True)
class PutBytesResult:
    stored_pages: int
    existing_pages: int


@dataclass(frozen=True)
class GetBytesResult:
    pages: tuple[PageBytes, ...]
    hit_pages: int


@dataclass(frozen=True)
class SessionPool:
    """One pool of a session: ``buffers`` as the daemon opened them ("memfd", "cuda-fd",
    "cuda-ipc", "bytes" = byte-only), ``data_path`` the worker's own label ("" = none)."""

    name: str
    buffers: str
    data_path: str


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    identity: WorkerIdentity
    group: str
    owned_pages: int
    lease_expires_unix_ms: int
    pools: tuple[SessionPool, ...] = ()


@dataclass(frozen=True)
class GroupInfo:
    group: str
    model_name: str
    pools: tuple[PoolInfo, ...]
    indexed_pages: int
    sessions: int
    # Attaches in progress and ended sessions whose calls still run: they keep the group in
    # use (not rebuilt, not retired) until done. 0 in a worker's own view, and from an older daemon.
    holds: int = 0


@dataclass(frozen=True)
class RetractionInfo:
    backup_id: str
    session_id: str
    request_id: str
    pages: int
    lease_expires_unix_ms: int


@dataclass(frozen=True)
class BackendInfo:
    name: str
    pages: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    corrupt_pages: int
    # Since the backend gave these figures (0 before it ever did), and why the last refresh
    # failed ("" when it succeeded: an outage shows here, beside the last figures).
    age_ms: int = 0
    error: str = ""


@dataclass(frozen=True)
class Stats:
    """A snapshot of the daemon (or of one session when asked for one)."""

    sessions: tuple[SessionInfo, ...]
    groups: tuple[GroupInfo, ...]
    backups: tuple[RetractionInfo, ...]
    backends: tuple[BackendInfo, ...]
    host_budget_bytes: int
    host_used_bytes: int
    draining: bool
    version: str

    def pools(self) -> tuple[PoolInfo, ...]:
        """Every pool of every group."""
        return tuple(p for g in self.groups for p in g.pools)

    def free_pages(self) -> dict[str, int]:
        """``group/pool -> free host pages`` for every pool of every group."""
        return {f"{g.group}/{p.name}": p.free_pages for g in self.groups for p in g.pools}

    def session(self, session_id: str) -> SessionInfo | None:
        """The session ``session_id`` or ``None`` when the daemon does not list it."""
        return next((s for s in self.sessions if s.session_id == session_id), None)


@dataclass(frozen=True)
class DrainResult:
    flushed_pages: int


@dataclass(frozen=True)
class ClearNamespaceResult:
    l2_pages: int
    l3_pages: int
