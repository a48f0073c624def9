"""Stats snapshots the core returns: plain frozen values, safe to share across threads."""

from __future__ import annotations

from dataclasses import dataclass

from hicached.core.types import PoolState, WorkerId


@dataclass(frozen=True)
class SessionStats:
    session_id: str
    worker: WorkerId
    group_id: str
    owned_pages: int
    lease_expires_unix_ms: int


@dataclass(frozen=True)
class GroupStats:
    group_id: str
    model_name: str
    pools: tuple[PoolState, ...]
    indexed_pages: int
    sessions: int


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
