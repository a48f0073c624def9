"""Plain request/result types of the core service (the servicer converts protos to these)."""

from __future__ import annotations

from dataclasses import dataclass

from hicached_client import vocab

from hicached.l2.group import PoolTransfer
from hicached.l2.layout import HostLayout, KVSpec
from hicached.transfer.handles import BufferSpec

__all__ = [
    "Ack",
    "AttachResult",
    "PoolRequest",
    "PoolRole",
    "PoolState",
    "PoolTransfer",
    "WorkerId",
]


# The client's wire vocabulary is the daemon's: one definition of the enum.
PoolRole = vocab.PoolRole


@dataclass(frozen=True)
class WorkerId:
    """A worker slot is (instance_id, tp_rank, pp_rank); generation orders its restarts."""

    instance_id: str
    generation: int
    model_name: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # Fixed at attach: every keyed call of the session uses this tenant's pages only.
    tenant: str = ""

    @property
    def slot(self) -> tuple[str, int, int]:
        return (self.instance_id, self.tp_rank, self.pp_rank)


@dataclass(frozen=True)
class PoolRequest:
    """One device pool of an attaching worker and the host pool it wants."""

    name: str
    role: PoolRole
    spec: KVSpec
    layout: HostLayout
    k_buffers: tuple[BufferSpec, ...]
    v_buffers: tuple[BufferSpec, ...]
    indices_from_pool: str = ""
    packed_draft_layers: int = 0
    layer_ids: tuple[int, ...] = ()
    host_ratio: float | None = None
    host_bytes: int | None = None
    # The worker's own label for its buffers (PoolSpec.data_path), only reported in stats.
    data_path: str = ""

    @property
    def byte_only(self) -> bool:
        """No device buffers: the session moves this pool's pages only as bytes (PutBytes/GetBytes)."""
        return not self.k_buffers and not self.v_buffers

    def signature(self) -> tuple[object, ...]:
        """What must match for two workers to share this pool's host pages."""
        s = self.spec
        return (
            self.name,
            self.role.value,
            self.indices_from_pool,
            s.kind.value,
            str(s.dtype),
            s.num_layers,
            s.num_heads,
            s.head_dim,
            s.page_size,
            self.layout.value,
            self.packed_draft_layers,
        )


@dataclass(frozen=True)
class PoolState:
    name: str
    role: PoolRole
    layout: HostLayout
    page_size: int
    total_pages: int
    free_pages: int
    page_bytes: int
    segment: str


@dataclass(frozen=True)
class AttachResult:
    session_id: str
    lease_ms: int
    pools: tuple[PoolState, ...]
    joined_existing_group: bool
    replaced_session_id: str = ""
    # The session's capability: every later call naming session_id must present it.
    session_secret: str = ""
    group: str = ""  # the pool group joined or created


@dataclass(frozen=True)
class PeerCred:
    """Credentials of a Unix-socket peer as the kernel reported them (SO_PEERCRED).

    Bound to a session at attach; never taken from anything the client says.
    """

    uid: int
    gid: int
    pid: int


@dataclass(frozen=True)
class Ack:
    pool: str
    pages: int
    tokens: int
    bytes: int


@dataclass(frozen=True)
class TransferResult:
    """Result of write / resolve: ``ok`` False = no host room (nothing changed)."""

    ok: bool
    transfers: tuple[PoolTransfer, ...] = ()
    acks: tuple[Ack, ...] = ()
    # With ok False: why (the allocator's words, for the worker's log).
    reason: str = ""


@dataclass(frozen=True)
class RetractResult:
    ok: bool
    backup_id: str = ""
    lease_expires_unix_ms: int = 0
    acks: tuple[Ack, ...] = ()
