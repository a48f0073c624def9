"""HiCacheCore: every daemon operation, on plain Python types.

The gRPC servicer converts messages to these calls and exceptions to status
codes; nothing here knows about gRPC. Calls block (they wait for the copy
engine), so the servicer runs them on a thread pool.

Atomicity: each mutating call validates everything first, then allocates,
then copies; when a later step fails, what the call allocated is freed before
the error propagates. ``Session.run`` makes a retried (rpc, op_id) return
the first remembered outcome (see :mod:`hicached.core.sessions`). Ownership: a host page is owned by exactly one holder at a time — a
session's ledger, a retraction backup, or the content index — and is freed by
that holder exactly once (``GroupState.free`` defers frees that race a copy).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np

from hicached.config import Config
from hicached.core.checks import bind_derived, check_indices, check_owned, check_transfers, known_pool
from hicached.core.group_state import GroupState
from hicached.core.groups import GroupRegistry, validate_pool_requests, validate_worker
from hicached.core.hooks import CoreHooks
from hicached.core.retraction import BackupStore
from hicached.core.sessions import Backup, PageLedger, Session, SessionTable, now_ms
from hicached.core.stats import BackupStats, DaemonStats, GroupStats, session_pools
from hicached.core.types import (
    Ack,
    AttachResult,
    PeerCred,
    PoolRequest,
    PoolRole,
    RetractResult,
    TransferResult,
    WorkerId,
)
from hicached.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from hicached.l2.allocator import as_page_array
from hicached.l2.group import PoolTransfer
from hicached.transfer.engine import CopyEngine, Priority
from hicached.transfer.handles import DeviceMappings, medium_of
from hicached.transfer.plan import DevicePoolView, Direction, build_plan

logger = logging.getLogger(__name__)

LayerCallback = Callable[[int], None]


class HiCacheCore:
    """Thread-safe: sessions, groups and backups each have their own lock."""

    def __init__(
        self,
        config: Config,
        *,
        groups: GroupRegistry,
        engine: CopyEngine,
        attach_index: Callable[[GroupState], None] | None = None,
        hooks: CoreHooks | None = None,
    ) -> None:
        self._cfg = config
        self._groups = groups
        self._engine = engine
        self._attach_index = attach_index or (lambda state: None)
        self._hooks = hooks or CoreHooks()
        self._sessions = SessionTable()
        self._backups = BackupStore()
        self._detached: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._detached_lock = threading.Lock()
        self._draining = threading.Event()
        self._closed = False

    # ------------------------------------------------------------------ sessions

    def attach(
        self,
        worker: WorkerId,
        pools: Sequence[PoolRequest],
        *,
        lease_ms: int = 0,
        peer: PeerCred | None = None,
    ) -> AttachResult:
        if self._draining.is_set():
            raise Unavailable("daemon is draining: no new sessions; attach to the replacement daemon")
        if not worker.instance_id:
            raise InvalidArgument("identity.instance_id must not be empty")
        if not worker.model_name:
            raise InvalidArgument("identity.model_name must not be empty")
        lease = self._lease(lease_ms)
        validate_worker(worker)
        validate_pool_requests(pools)  # before any mapping is opened
        replaced = self._sessions.check_generation(worker)
        if (
            replaced is not None
            and replaced.peer is not None
            and (peer is None or peer.uid != replaced.peer.uid)
        ):
            # A worker slot belongs to the uid that attached it: another peer may not end it.
            raise PermissionDenied(
                f"worker {worker.instance_id[:64]!r} (tp_rank={worker.tp_rank}, pp_rank={worker.pp_rank}) "
                f"is attached by uid {replaced.peer.uid}; only that uid may replace it"
            )
        mappings = DeviceMappings()
        try:
            views = self._open_views(mappings, pools)
            state, joined = self._groups.get_or_create(
                worker,
                pools,
                idle=lambda gid: self._sessions.in_group(gid) == 0,
                on_create=self._attach_index,
            )
        except BaseException:
            mappings.close()
            raise
        if replaced is not None:
            self._end(replaced, "replaced", wait_s=self._cfg.limits.max_wait_s)
        session = Session(
            session_id=SessionTable.new_id(),
            worker=worker,
            group_id=state.group_id,
            lease_ms=lease,
            mappings=mappings,
            views=views,
            ledger=PageLedger({e.name: e.host_pool.total_pages for e in state.group.entries}),
            op_cache_size=self._cfg.sessions.op_cache_size,
            peer=peer,
            op_cache_bytes=self._cfg.sessions.op_cache_bytes,
            pools=session_pools(pools),
        )
        self._sessions.add(session)
        self._hooks.on_session("attach", session)
        logger.info(
            "session attached",
            extra={
                "event": "attach",
                "session": session.session_id,
                "instance": worker.instance_id,
                "generation": worker.generation,
                "model": worker.model_name,
                "group": state.group_id,
                "joined": joined,
                "peer_uid": peer.uid if peer else None,
                "peer_pid": peer.pid if peer else None,
            },
        )
        return AttachResult(
            session_id=session.session_id,
            lease_ms=lease,
            pools=state.states(),
            joined_existing_group=joined,
            replaced_session_id=replaced.session_id if replaced else "",
            session_secret=session.secret,
        )

    def _lease(self, lease_ms: int) -> int:
        s = self._cfg.sessions
        if lease_ms == 0:
            return s.lease_ms
        if not s.min_lease_ms <= lease_ms <= s.max_lease_ms:
            raise InvalidArgument(f"lease_ms={lease_ms} outside [{s.min_lease_ms}, {s.max_lease_ms}]")
        return lease_ms

    @staticmethod
    def _open_views(mappings: DeviceMappings, pools: Sequence[PoolRequest]) -> dict[str, DevicePoolView]:
        views = {}
        for p in pools:
            if p.byte_only:
                continue
            k = [mappings.open(b) for b in p.k_buffers]
            v = [mappings.open(b) for b in p.v_buffers]
            for i, t in enumerate((*k, *v)):
                want = (p.spec.num_heads, p.spec.head_dim)
                if tuple(t.shape[1:]) != want or t.dtype != p.spec.dtype:
                    raise InvalidArgument(
                        f"pool {p.name!r} buffer {i}: shape {list(t.shape)} / dtype {t.dtype} does not match "
                        f"the pool spec (tokens, {want[0]}, {want[1]}) / {p.spec.dtype}"
                    )
            if len({t.shape[0] for t in (*k, *v)}) != 1:
                raise InvalidArgument(f"pool {p.name!r}: all buffers must have the same number of tokens")
            layer_ids = list(p.layer_ids) if p.layer_ids else list(range(p.spec.num_layers))
            views[p.name] = DevicePoolView(
                name=p.name, k=k, v=v, page_size=p.spec.page_size, layer_ids=layer_ids, medium=medium_of(k[0])
            )
        return views

    def detach(self, session_id: str, op_id: str = "") -> int:
        try:
            session = self._sessions.get(session_id)
        except NotFound:
            # A retried detach whose first attempt succeeded gets the first answer.
            with self._detached_lock:
                done = self._detached.get((session_id, op_id)) if op_id else None
            if done is None:
                raise
            return done
        freed = session.run(
            "Detach",
            op_id,
            (),
            lambda: self._end(session, "detach", wait_s=self._cfg.limits.max_wait_s),
            in_flight=False,
        )
        if op_id:
            with self._detached_lock:
                self._detached[(session_id, op_id)] = freed
                while len(self._detached) > self._cfg.sessions.op_cache_size:
                    self._detached.popitem(last=False)
        return freed

    def heartbeat(self, session_id: str) -> int:
        session = self._sessions.get(session_id)
        return session.touch()

    def expire(self, now: int | None = None) -> list[str]:
        """End sessions whose lease ran out and drop retraction backups past their lease."""
        now = now_ms() if now is None else now
        ended = []
        for session in self._sessions.expired(now):
            self._end(session, "expired")
            ended.append(session.session_id)
        for b in self._backups.take_expired(now):
            self._free_backup(b)
        return ended

    def _end(self, session: Session, reason: str, *, wait_s: float = 0.0) -> int:
        """Cancel, wait at most ``wait_s`` for in-flight work, then unmap and free everything
        the session held. Past the deadline the session is gone already and its teardown
        runs when its last operation finishes (an L3 call may hang): returns 0 then, the
        pages freed so far. The lease reaper waits 0 s, so it never blocks on a session."""
        if self._sessions.remove(session.session_id) is None:
            return 0
        session.cancel.set()
        self._engine.cancel_owner(session.session_id)
        if not session.wait_idle(wait_s):
            logger.warning(
                "session ended with operations in flight; its pages are freed when they finish",
                extra={"event": reason, "session": session.session_id, "in_flight": session.in_flight},
            )
            session.when_idle(functools.partial(self._teardown_quietly, session, reason))
            return 0
        return self._teardown(session, reason)

    def _teardown_quietly(self, session: Session, reason: str) -> None:
        """A deferred teardown (run by the session's last operation): its failure is logged,
        never raised into that operation's answer."""
        try:
            self._teardown(session, reason)
        except Exception:
            logger.exception("deferred teardown of session %s failed", session.session_id)

    def _teardown(self, session: Session, reason: str) -> int:
        """Unmap and free what an ended, idle session held."""
        state = self._groups.get(session.group_id)
        freed = 0
        for pool, pages in session.ledger.take_all().items():
            freed += state.free(pool, pages)
        for b in self._backups.take_session(session.session_id):
            freed += self._free_backup(b)
        index = state.index
        for pid in list(session.prefetches):
            if index is not None:
                with contextlib.suppress(NotFound):
                    index.get_prefetch(pid).cancel()
        session.mappings.close()
        self._hooks.on_session(reason, session)
        logger.info(
            "session ended",
            extra={"event": reason, "session": session.session_id, "freed_pages": freed},
        )
        return freed

    def _free_backup(self, backup: Backup) -> int:
        return self._groups.get(backup.group_id).release_transfers(backup.transfers)

    # ------------------------------------------------------------ request checks

    def _session(self, session_id: str) -> tuple[Session, GroupState]:
        session = self._sessions.get(session_id)
        session.touch()  # any call proves the worker alive, not only heartbeats
        return session, self._groups.get(session.group_id)

    def check_transfers(
        self,
        session: Session,
        state: GroupState,
        transfers: Sequence[PoolTransfer],
        *,
        need_device: bool = True,
        host: str = "optional",  # "required", "optional", "forbidden"
    ) -> list[PoolTransfer]:
        """:func:`hicached.core.checks.check_transfers` under this daemon's batch limit."""
        return check_transfers(
            session,
            state,
            transfers,
            max_batch_pages=self._cfg.server.max_batch_pages,
            need_device=need_device,
            host=host,
        )

    # ----------------------------------------------------------------- the copies

    def copy_pages(
        self,
        session: Session,
        state: GroupState,
        direction: Direction,
        transfers: Sequence[PoolTransfer],
        *,
        priority: Priority,
        on_layer: LayerCallback | None = None,
    ) -> tuple[Ack, ...]:
        items = []
        busy = []
        for t in transfers:
            if t.host_indices is None or t.device_indices is None or len(t.device_indices) == 0:
                continue
            items.append((session.views[t.name], state.pool(t.name), t.device_indices, t.host_indices))
            busy.append((t.name, t.host_indices))
        plan = build_plan(direction, items)
        state.acquire(busy)
        try:
            future = self._engine.submit(
                plan, priority=priority, owner=session.session_id, on_layer=on_layer, cancel=session.cancel
            )
            result = future.result()
        finally:
            state.release(busy)
        self._hooks.on_copy(direction, plan, result.seconds, model=state.model_name)
        return tuple(
            Ack(
                pool=t.name,
                pages=len(t.device_indices) if t.device_indices is not None else 0,
                tokens=plan.tokens_by_pool.get(t.name, 0),
                bytes=plan.bytes_by_pool.get(t.name, 0),
            )
            for t in transfers
        )

    def allocate(
        self, session: Session, state: GroupState, transfers: Sequence[PoolTransfer]
    ) -> TransferResult:
        """Allocate missing host pages across the group (atomic); record ownership."""
        result = state.group.resolve_all(list(transfers))
        if not result.ok:
            return TransferResult(ok=False, reason=result.reason)
        for t in result.transfers:
            if t.host_allocated and t.host_indices is not None:
                session.ledger.add(t.name, t.host_indices)
        return TransferResult(ok=True, transfers=tuple(result.transfers))

    def release_owned(self, session: Session, state: GroupState, transfers: Iterable[PoolTransfer]) -> int:
        """Free the session's allocated pages of ``transfers`` (derived ones skipped by role).

        Atomic: ``state.release_transfers`` validates the whole batch before
        freeing; the ledger forgets the pages only once they are freed.
        """
        owned = state.allocated_transfers(transfers)
        freed = state.release_transfers(owned)
        for t in owned:
            session.ledger.remove(t.name, t.host_indices)  # type: ignore[arg-type]
        return freed

    # ---------------------------------------------------------------- host pages

    def alloc(self, session_id: str, op_id: str, pool: str, num_pages: int) -> np.ndarray | None:
        session, state = self._session(session_id)
        known_pool(state, pool)
        entry = state.group.get_entry(pool)
        if entry.indices_from_pool:
            raise InvalidArgument(
                f"pool {pool!r} is derived from {entry.indices_from_pool!r}: it does not allocate"
            )
        if num_pages <= 0 or num_pages > self._cfg.server.max_batch_pages:
            raise InvalidArgument(
                f"num_pages={num_pages} must lie in [1, server.max_batch_pages={self._cfg.server.max_batch_pages}]"
            )

        def run() -> np.ndarray | None:
            got = state.group.allocate({pool: num_pages})
            if not got.ok:
                return None
            pages = got.pages[pool]
            session.ledger.add(pool, pages)
            return pages

        return session.run("Alloc", op_id, (pool, num_pages), run)

    def free(self, session_id: str, op_id: str, pool: str, pages: Sequence[int] | np.ndarray) -> int:
        session, state = self._session(session_id)
        known_pool(state, pool)
        arr = as_page_array(pages, f"pool {pool!r} host pages")

        def run() -> int:
            check_indices(pool, "host", arr, state.pool(pool).num_pages)
            check_owned(session, state, [PoolTransfer(pool, arr, arr)])
            freed = state.free(pool, arr)
            session.ledger.remove(pool, arr)
            return freed

        return session.run("Free", op_id, (pool, arr), run)

    def resolve(self, session_id: str, op_id: str, transfers: Sequence[PoolTransfer]) -> TransferResult:
        session, state = self._session(session_id)
        checked = self.check_transfers(session, state, transfers)

        def run() -> TransferResult:
            check_owned(session, state, checked)  # inside: a replay must not re-check
            return self.allocate(session, state, checked)

        return session.run("ResolveTransfers", op_id, checked, run)

    def release(self, session_id: str, op_id: str, transfers: Sequence[PoolTransfer]) -> int:
        session, state = self._session(session_id)
        checked = self.check_transfers(session, state, transfers, need_device=False, host="required")
        flagged = [
            replace(c, host_allocated=t.host_allocated) for c, t in zip(checked, transfers, strict=True)
        ]

        def run() -> int:
            check_owned(session, state, state.allocated_transfers(flagged))  # the whole batch first
            return self.release_owned(session, state, flagged)

        return session.run("ReleaseTransfers", op_id, flagged, run)

    # ---------------------------------------------------------------- data plane

    def write(
        self, session_id: str, op_id: str, transfers: Sequence[PoolTransfer], *, allocate: bool
    ) -> TransferResult:
        session, state = self._session(session_id)
        checked = self.check_transfers(session, state, transfers, host="optional" if allocate else "required")
        if not allocate:
            checked = bind_derived(state, checked)

        def run() -> TransferResult:
            check_owned(session, state, checked)
            resolved = (
                self.allocate(session, state, checked) if allocate else TransferResult(True, tuple(checked))
            )
            if not resolved.ok:
                return resolved
            try:
                acks = self.copy_pages(
                    session, state, Direction.D2H, resolved.transfers, priority=Priority.DEMAND
                )
            except BaseException:
                self.release_owned(session, state, resolved.transfers)
                raise
            return TransferResult(ok=True, transfers=resolved.transfers, acks=acks)

        return session.run("Write", op_id, (checked, allocate), run)

    def load(
        self,
        session_id: str,
        op_id: str,
        transfers: Sequence[PoolTransfer],
        *,
        on_layer: LayerCallback | None = None,
    ) -> tuple[Ack, ...]:
        session, state = self._session(session_id)
        checked = bind_derived(state, self.check_transfers(session, state, transfers, host="required"))

        def run() -> tuple[Ack, ...]:
            check_owned(session, state, checked)
            return self.copy_pages(
                session, state, Direction.H2D, checked, priority=Priority.DEMAND, on_layer=on_layer
            )

        return session.run("Load", op_id, checked, run)

    # ---------------------------------------------------------------- retraction

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
        session, state = self._session(session_id)
        checked = self.check_transfers(session, state, transfers, host="forbidden")
        anchor = state.group.anchor.name
        if not any(t.name == anchor for t in checked):
            raise InvalidArgument(f"a retraction backup must include the anchor pool {anchor!r}")
        pages = max(len(t.device_indices) for t in checked if t.device_indices is not None)
        page_size = state.pool(anchor).page_size
        if num_tokens < 0 or num_tokens > pages * page_size:
            raise InvalidArgument(
                f"num_tokens={num_tokens} exceeds the {pages} pages x page_size={page_size}"
            )
        lease = lease_ms or self._cfg.sessions.retraction_lease_ms

        def run() -> RetractResult:
            result = state.group.resolve_all(checked)
            if not result.ok:
                logger.info("retraction backup declined: no host room", extra={"session": session_id})
                return RetractResult(ok=False)
            try:
                acks = self.copy_pages(
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
        session, state = self._session(session_id)

        def run() -> tuple[Ack, ...]:
            backup = self._backups.owned(session.session_id, backup_id)
            checked = bind_derived(state, self.check_transfers(session, state, transfers, host="forbidden"))
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
                        f"restore of pool {name!r}: backup holds {want} pages, got {got} device pages"
                    )
            bound = [replace(t, host_indices=saved[t.name].host_indices) for t in checked]
            if self._backups.take(backup_id) is None:
                raise NotFound(
                    f"unknown retraction backup {backup_id!r} (restored or discarded concurrently)"
                )
            try:
                acks = self.copy_pages(
                    session, state, Direction.H2D, bound, priority=Priority.RESTORE, on_layer=on_layer
                )
            except BaseException:
                self._backups.add(backup)  # the backup stays restorable
                raise
            state.release_transfers(backup.transfers)
            return acks

        return session.run("RetractRestore", op_id, (backup_id, transfers), run)

    def retract_discard(self, session_id: str, op_id: str, backup_id: str) -> int:
        session, state = self._session(session_id)

        def run() -> int:
            backup = self._backups.owned(session.session_id, backup_id)
            if self._backups.take(backup_id) is None:
                raise NotFound(f"unknown retraction backup {backup_id!r}")
            return state.release_transfers(backup.transfers)

        return session.run("RetractDiscard", op_id, backup_id, run)

    # ------------------------------------------------------------------- admin

    def stats(self, session_id: str = "") -> DaemonStats:
        sessions = self._sessions.all()
        if session_id:
            sessions = [self._sessions.get(session_id)]
        groups = self._groups.all()
        if session_id:
            groups = [g for g in groups if g.group_id == sessions[0].group_id]
        backups = self._backups.snapshot(session_id)
        return DaemonStats(
            sessions=tuple(s.stats() for s in sessions),
            groups=tuple(
                GroupStats(
                    g.group_id,
                    g.model_name,
                    g.states(),
                    _indexed(g),
                    self._sessions.in_group(g.group_id),
                )
                for g in groups
            ),
            backups=tuple(
                BackupStats(b.backup_id, b.session_id, b.request_id, b.pages, b.expires_ms) for b in backups
            ),
            host_budget_bytes=self._groups.budget_bytes,
            host_used_bytes=self._groups.used_bytes(),
            draining=self._draining.is_set(),
        )

    def live_session_ids(self) -> frozenset[str]:
        """Ids of the sessions alive now (no lease is touched)."""
        return frozenset(s.session_id for s in self._sessions.all())

    def check_secret(self, session_id: str, secret: str) -> None:
        """PermissionDenied unless ``secret`` is session ``session_id``'s secret (unknown ids pass)."""
        self._sessions.check_secret(session_id, secret)

    def anchor_pool(self, session_id: str) -> str:
        """The name of the anchor pool of session ``session_id``'s group (NotFound for unknown ids)."""
        return self._session(session_id)[1].group.anchor.name

    def session_worker(self, session_id: str) -> WorkerId:
        """The worker identity session ``session_id`` attached with (NotFound for unknown ids)."""
        return self._session(session_id)[0].worker

    def session_group(self, session_id: str) -> tuple[Session, GroupState]:
        """For the content-cache operations (``hicached.core.keyed``)."""
        return self._session(session_id)

    @property
    def allocation_may_block(self) -> bool:
        """True when an allocation can wait on L3 I/O (write_back eviction writes before freeing)."""
        l3 = self._cfg.l3
        return l3.backend != "none" and l3.write_policy == "write_back"

    @property
    def config(self) -> Config:
        return self._cfg

    @property
    def groups(self) -> GroupRegistry:
        return self._groups

    @property
    def engine(self) -> CopyEngine:
        return self._engine

    def set_draining(self) -> None:
        self._draining.set()

    def resume(self) -> bool:
        """Undo :meth:`set_draining` (new sessions are accepted again); True if it was draining."""
        was = self._draining.is_set()
        self._draining.clear()
        return was

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def close(self) -> None:
        """End every session (freeing their pages), then release the groups."""
        if self._closed:
            return
        self._closed = True
        for session in self._sessions.all():
            self._end(session, "shutdown", wait_s=self._cfg.server.grace_s)
        for b in self._backups.take_all():
            self._free_backup(b)
        self._groups.close()


def _indexed(state: GroupState) -> int:
    return 0 if state.index is None else state.index.stats().entries


__all__ = ["HiCacheCore", "PoolRole"]
