"""Retraction: a retracted request's pages backed up to host and restored (or discarded).

:class:`BackupStore` holds the backups with their own lock; :class:`Retraction` is the room
of :class:`hicached.core.service.HiCacheCore` that makes, restores and discards them.
A backup owns its host pages (see :mod:`hicached.core.service` on ownership): the
store only keeps the records; whoever takes a record out frees its pages exactly once.
Thread-safe: every store method holds the store's lock for a dict operation only, never
across a copy or a free.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import replace

from hicached.core.checks import bind_derived
from hicached.core.dataplane import DataPlane, LayerCallback
from hicached.core.sessions import Backup, now_ms
from hicached.core.types import Ack, RetractResult
from hicached.errors import InvalidArgument, NotFound, clip
from hicached.l2.group import PoolTransfer
from hicached.transfer.engine import Priority
from hicached.transfer.plan import Direction

logger = logging.getLogger(__name__)


class BackupStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backups: dict[str, Backup] = {}

    def add(self, backup: Backup) -> None:
        """Keep ``backup`` (a new one, or one put back after a failed restore)."""
        with self._lock:
            self._backups[backup.backup_id] = backup

    def owned(self, session_id: str, backup_id: str) -> Backup:
        """The backup, if session ``session_id`` made it; NotFound otherwise, in the same words
        for another session's backup as for an unknown one (no confirming that an id exists)."""
        with self._lock:
            backup = self._backups.get(backup_id)
        if backup is None or backup.session_id != session_id:
            raise NotFound(
                f"unknown retraction backup {clip(backup_id)} for this session "
                "(restored, discarded, expired, or made by another session)"
            )
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

    def __len__(self) -> int:
        """The backups held now (the ``hicached_retraction_backups`` gauge)."""
        with self._lock:
            return len(self._backups)

    def snapshot(self, session_id: str = "") -> list[Backup]:
        """The backups (of one session when ``session_id`` is given), for stats."""
        with self._lock:
            return [b for b in self._backups.values() if not session_id or b.session_id == session_id]


class Retraction:
    """RetractBackup / RetractRestore / RetractDiscard over ``data``'s checks and copies.

    Thread-safe: the backups are in ``backups`` (its own lock); nothing else is kept here.
    ``lease_ms`` is the default lifetime of a backup whose request names none;
    ``lease_range_ms`` bounds one a request names (``sessions.min_lease_ms`` and the larger of
    ``sessions.max_lease_ms`` and the default).
    """

    def __init__(
        self, data: DataPlane, backups: BackupStore, *, lease_ms: int, lease_range_ms: tuple[int, int]
    ) -> None:
        self._data = data
        self._backups = backups
        self._lease_ms = lease_ms
        self._lease_range_ms = lease_range_ms

    def retract_backup(
        self,
        session_id: str,
        op_id: str,
        request_id: str,
        transfers: Sequence[PoolTransfer],
        *,
        num_tokens: int,
        lease_ms: int = 0,
    ) -> RetractResult:
        session, state = self._data.session(session_id)
        checked = self._data.check_transfers(session, state, transfers, host="forbidden")
        anchor = state.group.anchor.name
        if not any(t.name == anchor for t in checked):
            raise InvalidArgument(f"a retraction backup must include the anchor pool {clip(anchor)}")
        pages = max((len(t.device_indices) for t in checked if t.device_indices is not None), default=0)
        if pages == 0:
            # Each backup holds pages until restored, discarded or expired: the host pool bounds
            # how many there are. One of none would be a record held for nothing.
            raise InvalidArgument("a retraction backup needs at least one device page")
        low, high = self._lease_range_ms
        if lease_ms and not low <= lease_ms <= high:
            raise InvalidArgument(
                f"lease_ms={lease_ms} outside [{low}, {high}] (sessions.min_lease_ms, sessions.max_lease_ms)"
            )
        page_size = state.pool(anchor).page_size
        if num_tokens < 0 or num_tokens > pages * page_size:
            raise InvalidArgument(
                f"num_tokens={num_tokens} exceeds the {pages} pages x page_size={page_size}"
            )
        lease = lease_ms or self._lease_ms

        def run() -> RetractResult:
            result = state.group.resolve_all(checked, copy_in=True)
            if not result.ok:
                logger.info("retraction backup declined: no host room", extra={"session": session_id})
                return RetractResult(ok=False)
            try:
                acks = self._data.copy_pages(
                    session, state, Direction.D2H, result.transfers, priority=Priority.DEMAND
                )
            except BaseException:
                state.release_transfers(result.transfers)
                raise
            backup = Backup(
                backup_id=uuid.uuid4().hex,
                session_id=session.session_id,
                group_id=state.group_id,
                request_id=request_id,
                transfers=tuple(result.transfers),
                num_tokens=num_tokens,
                expires_ms=now_ms() + lease,
            )
            self._backups.add(backup)
            return RetractResult(
                ok=True, backup_id=backup.backup_id, lease_expires_unix_ms=backup.expires_ms, acks=acks
            )

        return session.run("RetractBackup", op_id, (request_id, checked, num_tokens, lease), run)

    def retract_restore(
        self,
        session_id: str,
        op_id: str,
        backup_id: str,
        transfers: Sequence[PoolTransfer],
        *,
        on_layer: LayerCallback | None = None,
    ) -> tuple[Ack, ...]:
        session, state = self._data.session(session_id)

        def run() -> tuple[Ack, ...]:
            backup = self._backups.owned(session.session_id, backup_id)
            checked = bind_derived(
                state, self._data.check_transfers(session, state, transfers, host="forbidden")
            )
            saved = {t.name: t for t in backup.transfers}
            given = {t.name: t for t in checked}
            if set(saved) != set(given):
                raise InvalidArgument(
                    f"restore must name the same pools as the backup: backup has {sorted(saved)}, got {sorted(given)}"
                )
            for name, t in given.items():
                saved_pages = saved[name].host_indices
                want = 0 if saved_pages is None else len(saved_pages)
                got = 0 if t.device_indices is None else len(t.device_indices)
                if got != want:
                    raise InvalidArgument(
                        f"restore of pool {clip(name)}: backup holds {want} pages, got {got} device pages"
                    )
            bound = [replace(t, host_indices=saved[t.name].host_indices) for t in checked]
            if self._backups.take(backup_id) is None:
                raise NotFound(
                    f"unknown retraction backup {clip(backup_id)} (restored or discarded concurrently)"
                )
            try:
                acks = self._data.copy_pages(
                    session, state, Direction.H2D, bound, priority=Priority.RESTORE, on_layer=on_layer
                )
            except BaseException:
                self._backups.add(backup)  # the backup stays restorable
                raise
            state.release_transfers(backup.transfers)
            return acks

        return session.run("RetractRestore", op_id, (backup_id, transfers), run)

    def retract_discard(self, session_id: str, op_id: str, backup_id: str) -> int:
        session, state = self._data.session(session_id)

        def run() -> int:
            backup = self._backups.owned(session.session_id, backup_id)
            if self._backups.take(backup_id) is None:
                raise NotFound(f"unknown retraction backup {clip(backup_id)}")
            return state.release_transfers(backup.transfers)

        return session.run("RetractDiscard", op_id, backup_id, run)
