"""Stats snapshots the core returns: plain frozen values, safe to share across threads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hicached.core.types import PoolRequest, PoolState, WorkerId
from hicached.transfer.handles import CudaFdBufferHandle, CudaIpcBufferHandle, FdBufferHandle

# How the daemon reaches a pool's buffers, by the handle it opened.
_BUFFERS = {FdBufferHandle: "memfd", CudaFdBufferHandle: "cuda-fd", CudaIpcBufferHandle: "cuda-ipc"}


@dataclass(frozen=True)
class SessionPoolStats:
    """One pool of a session: ``buffers`` as the daemon opened them, ``data_path`` the worker's label."""

    name: str
    buffers: str
    data_path: str


def session_pools(pools: Sequence[PoolRequest]) -> tuple[SessionPoolStats, ...]:
    """What stats report about an attaching session's pools (fixed for the session's life)."""
    return tuple(
        SessionPoolStats(
            p.name,
            "bytes" if p.byte_only else _BUFFERS.get(type(p.k_buffers[0].handle), "other"),
            p.data_path,
        )
        for p in pools
    )


@dataclass(frozen=True)
class SessionStats:
    session_id: str
    worker: WorkerId
    group_id: str
    owned_pages: int
    lease_expires_unix_ms: int
    pools: tuple[SessionPoolStats, ...] = ()


@dataclass(frozen=True)
class GroupStats:
    group_id: str
    model_name: str
    pools: tuple[PoolState, ...]
    indexed_pages: int
    sessions: int
    holds: int  # attaches in progress and ended sessions still tearing down (SessionTable.hold)


@dataclass(frozen=True)
class BackupStats:
    backup_id: str
    session_id: str
    request_id: str
    pages: int
    lease_expires_unix_ms: int


@dataclass(frozen=True)
class DaemonStats:
    sessions: tuple[SessionStats, ...]
    groups: tuple[GroupStats, ...]
    backups: tuple[BackupStats, ...]
    host_budget_bytes: int
    host_used_bytes: int
    draining: bool
