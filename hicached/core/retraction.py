"""BackupStore: retraction backups held by the daemon, with their own lock.

A backup owns its host pages (see :mod:`hicached.core.service` on ownership): the
store only keeps the records; whoever takes a record out frees its pages exactly once.
Thread-safe: every method holds the store's lock for a dict operation only, never
across a copy or a free.
"""

from __future__ import annotations

import threading

from hicached.core.sessions import Backup
from hicached.errors import NotFound, PermissionDenied


class BackupStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backups: dict[str, Backup] = {}

    def add(self, backup: Backup) -> None:
        """Keep ``backup`` (a new one, or one put back after a failed restore)."""
        with self._lock:
            self._backups[backup.backup_id] = backup

    def owned(self, session_id: str, backup_id: str) -> Backup:
        """The backup, if session ``session_id`` made it: NotFound or PermissionDenied otherwise."""
        with self._lock:
            backup = self._backups.get(backup_id)
        if backup is None:
            raise NotFound(f"unknown retraction backup {backup_id!r} (restored, discarded or expired)")
        if backup.session_id != session_id:
            raise PermissionDenied(f"retraction backup {backup_id!r} belongs to another session")
        return backup

    def take(self, backup_id: str) -> Backup | None:
        """Remove and return the backup (None when another call took it first)."""
        with self._lock:
            return self._backups.pop(backup_id, None)

    def take_expired(self, now_ms: int) -> list[Backup]:
        """Remove and return the backups whose lease ended at or before ``now_ms``."""
        with self._lock:
            stale = [b for b in self._backups.values() if b.expires_ms <= now_ms]
            for b in stale:
                del self._backups[b.backup_id]
        return stale

    def take_session(self, session_id: str) -> list[Backup]:
        """Remove and return every backup session ``session_id`` made."""
        with self._lock:
            mine = [b for b in self._backups.values() if b.session_id == session_id]
            for b in mine:
                del self._backups[b.backup_id]
        return mine

    def take_all(self) -> list[Backup]:
        with self._lock:
            every = list(self._backups.values())
            self._backups.clear()
        return every

    def snapshot(self, session_id: str = "") -> list[Backup]:
        """The backups (of one session when ``session_id`` is given), for stats."""
        with self._lock:
            return [b for b in self._backups.values() if not session_id or b.session_id == session_id]
