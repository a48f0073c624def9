"""HiCacheCore: every daemon operation, on plain Python types.

The gRPC servicer converts messages to these calls and exceptions to status codes; nothing here
knows about gRPC. Calls block (they wait for the copy engine), so the servicer runs them on a lane.

Atomicity: each mutating call validates everything first, then allocates, then copies; when a
later step fails, what the call allocated is freed before the error propagates. ``Session.run``
makes a retried (rpc, op_id) return the first remembered outcome (:mod:`hicached.core.opcache`).
Ownership: a host page is owned by exactly one holder at a time — a session's ledger, a
retraction backup, or the content index — and is freed by that holder exactly once
(``GroupState.free`` defers frees that race a copy).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from hicached.config import Config
from hicached.core.attach_checks import validate_pool_requests, validate_worker
from hicached.core.checks import open_views
from hicached.core.dataplane import DataPlane, LayerCallback
from hicached.core.group_state import GroupState
from hicached.core.groups import GroupRegistry
from hicached.core.observer import CoreObserver, NullCoreObserver
from hicached.core.retraction import BackupStore, Retraction
from hicached.core.sessions import Backup, Session, SessionTable, now_ms
from hicached.core.stats import BackupStats, DaemonStats, GroupStats, session_pools
from hicached.core.tenants import TenantUids
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
from hicached.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from hicached.l2.group import PoolTransfer
from hicached.transfer.engine import CopyEngine
from hicached.transfer.mappings import DeviceMappings

logger = logging.getLogger(__name__)


class HiCacheCore:
    """Thread-safe: sessions, groups and backups each have their own lock.

    A thin facade over its rooms: this module holds sessions (attach, detach, leases,
    teardown) and admin; the page operations are :class:`~hicached.core.dataplane.DataPlane`'s
    and retraction is :class:`~hicached.core.retraction.Retraction`'s, both built here over
    the same session table, groups and engine, and exposed below one call each."""

    def __init__(
        self,
        config: Config,
        *,
        groups: GroupRegistry,
        engine: CopyEngine,
        attach_index: Callable[[GroupState], None] | None = None,
        observer: CoreObserver | None = None,
    ) -> None:
        self._cfg = config
        self._tenant_uids = TenantUids(config.sessions.tenant_uids)
        self._groups = groups
        self._engine = engine
        self._attach_index = attach_index or (lambda state: None)
        self._observer: CoreObserver = observer or NullCoreObserver()
        self._sessions = SessionTable()
        self._backups = BackupStore()
        self._data = DataPlane(
            config, groups=groups, engine=engine, sessions=self._sessions, observer=self._observer
        )
        sessions = config.sessions
        self._retraction = Retraction(
            self._data,
            self._backups,
            lease_ms=sessions.retraction_lease_ms,
            lease_range_ms=(sessions.min_lease_ms, max(sessions.max_lease_ms, sessions.retraction_lease_ms)),
        )
        self._detached: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._detached_lock = threading.Lock()
        self._draining = threading.Event()
        self._closed = False
        # Teardowns under way, and whether the groups are closing: close() waits for the
        # former, and a teardown that starts after it finds the group's pages freed already.
        self._teardowns = threading.Condition()
        self._tearing = 0
        self._groups_closed = False

    # -------------------------------------------------------- the rooms' operations

    @property
    def data(self) -> DataPlane:
        """The page operations on a session's checked requests (used by ``KeyedCache``)."""
        return self._data

    def alloc(self, session_id: str, op_id: str, pool: str, num_pages: int) -> np.ndarray | None:
        return self._data.alloc(session_id, op_id, pool, num_pages)

    def free(self, session_id: str, op_id: str, pool: str, pages: Sequence[int] | np.ndarray) -> int:
        return self._data.free(session_id, op_id, pool, pages)

    def resolve(self, session_id: str, op_id: str, transfers: Sequence[PoolTransfer]) -> TransferResult:
        return self._data.resolve(session_id, op_id, transfers)

    def release(self, session_id: str, op_id: str, transfers: Sequence[PoolTransfer]) -> int:
        return self._data.release(session_id, op_id, transfers)

    def write(
        self, session_id: str, op_id: str, transfers: Sequence[PoolTransfer], *, allocate: bool
    ) -> TransferResult:
        return self._data.write(session_id, op_id, transfers, allocate=allocate)

    def load(
        self,
        session_id: str,
        op_id: str,
        transfers: Sequence[PoolTransfer],
        *,
        on_layer: LayerCallback | None = None,
    ) -> tuple[Ack, ...]:
        return self._data.load(session_id, op_id, transfers, on_layer=on_layer)

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
        return self._retraction.retract_backup(
            session_id, op_id, request_id, transfers, num_tokens=num_tokens, lease_ms=lease_ms
        )

    def retract_restore(
        self,
        session_id: str,
        op_id: str,
        backup_id: str,
        transfers: Sequence[PoolTransfer],
        *,
        on_layer: LayerCallback | None = None,
    ) -> tuple[Ack, ...]:
        return self._retraction.retract_restore(session_id, op_id, backup_id, transfers, on_layer=on_layer)

    def retract_discard(self, session_id: str, op_id: str, backup_id: str) -> int:
        return self._retraction.retract_discard(session_id, op_id, backup_id)

    # ------------------------------------------------------------------ sessions

    def attach(
        self,
        worker: WorkerId,
        pools: Sequence[PoolRequest],
        *,
        lease_ms: int = 0,
        peer: PeerCred | None = None,
        origin: str = "",
        join_only: bool = False,
    ) -> AttachResult:
        """``peer``: the kernel's credentials of an fd handoff; ``origin``: who attaches as the
        transport tells (``hicached.server.peers.peer_key``; the handoff's uid wins). A worker
        slot's live session is replaced only from its own origin and tenant. ``join_only``:
        NotFound, creating nothing, unless the pools' group exists (``GroupRegistry``)."""
        if self._draining.is_set():
            raise Unavailable("daemon is draining: no new sessions; attach to the replacement daemon")
        if not worker.instance_id:
            raise InvalidArgument("identity.instance_id must not be empty")
        if not worker.model_name:
            raise InvalidArgument("identity.model_name must not be empty")
        lease = self._lease(lease_ms)
        validate_worker(worker)
        self._tenant_uids.check(worker.tenant, peer)
        validate_pool_requests(pools)  # before any mapping is opened
        origin = f"uid:{peer.uid}" if peer is not None else origin
        replaced = self._sessions.check_generation(worker, origin)
        mappings = DeviceMappings()
        try:
            views = open_views(mappings, pools)
            state, joined = self._groups.get_or_create(
                worker,
                pools,
                idle=self._sessions.unused,
                claim=self._sessions.hold,  # until add(): no other attach retires it meanwhile
                on_create=self._attach_index,
                join_only=join_only,
            )
        except BaseException:
            mappings.close()
            raise
        session: Session | None = None
        try:
            if replaced is not None:
                # Its calls in flight are not waited for: that held a bookkeeping thread each.
                self._end(replaced, "replaced")
            session = Session(
                session_id=SessionTable.new_id(),
                worker=worker,
                group_id=state.group_id,
                lease_ms=lease,
                mappings=mappings,
                views=views,
                ledger=state.owners.ledger(),
                op_cache_size=self._cfg.sessions.op_cache_size,
                peer=peer,
                origin=origin,
                op_cache_bytes=self._cfg.sessions.op_cache_bytes,
                pools=session_pools(pools),
            )
            self._sessions.add(session)
        except BaseException:
            self._sessions.unhold(state.group_id)
            if session is not None:
                session.ledger.take_all()  # owns nothing: gives its holder number back
            mappings.close()
            raise
        self._observer.on_session("attach", session)
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
            group=state.group_id,
        )

    def _lease(self, lease_ms: int) -> int:
        s = self._cfg.sessions
        if lease_ms == 0:
            return s.lease_ms
        if not s.min_lease_ms <= lease_ms <= s.max_lease_ms:
            raise InvalidArgument(f"lease_ms={lease_ms} outside [{s.min_lease_ms}, {s.max_lease_ms}]")
        return lease_ms

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
        """Cancel, wait at most ``wait_s`` for in-flight work, then unmap and free everything the
        session held. Past the deadline the session is gone and its teardown runs when its last
        operation finishes (an L3 call may hang): returns 0 then. The lease reaper waits 0 s."""
        if self._sessions.remove(session.session_id) is None:
            return 0
        session.cancel.set()
        try:
            self._engine.cancel_owner(session.session_id)
        except Exception:  # a bug there must not leave the session half ended (and its group held)
            logger.exception("cancelling the copies of session %s failed", session.session_id)
        if not session.wait_idle(wait_s):
            logger.warning(
                "session ended with operations in flight; its pages are freed when they finish",
                extra={"event": reason, "session": session.session_id, "in_flight": session.in_flight},
            )
            session.when_idle(functools.partial(self._teardown_quietly, session, reason))
            return 0
        return self._teardown(session, reason)

    def _teardown_quietly(self, session: Session, reason: str) -> None:
        """A deferred teardown (run by its session's last operation): failures logged, not raised."""
        try:
            self._teardown(session, reason)
        except Exception:
            logger.exception("deferred teardown of session %s failed", session.session_id)

    def _teardown(self, session: Session, reason: str) -> int:
        """Unmap and free what an ended, idle session held, then let its group go (the
        hold :meth:`SessionTable.remove` took). Thread-safe: runs on the ending thread or,
        deferred, on the thread of the session's last operation."""
        try:
            return self._teardown_held(session, reason)
        finally:
            self._sessions.unhold(session.group_id)

    def _teardown_held(self, session: Session, reason: str) -> int:
        with self._teardowns:
            closed = self._groups_closed
            self._tearing += 0 if closed else 1
        if closed:
            # The daemon closed the groups while this session's last operation ran (a shutdown
            # past its grace period): their close freed every page, so only the mappings are
            # left. Looking the group up raised NotFound and left the mappings mapped.
            session.ledger.take_all()
            session.plan_layers.clear()
            session.mappings.close()
            self._observer.on_session(reason, session)
            logger.info(
                "session ended after its pool group closed",
                extra={"event": reason, "session": session.session_id},
            )
            return 0
        try:
            return self._teardown_open(session, reason)
        finally:
            with self._teardowns:
                self._tearing -= 1
                self._teardowns.notify_all()

    def _teardown_open(self, session: Session, reason: str) -> int:
        freed = 0
        try:
            state = self._groups.get(session.group_id)
            if not session.ledger.of(state.owners):  # the hold makes this a bug, never a free
                raise FailedPrecondition(
                    f"pool group {session.group_id} was rebuilt while session {session.session_id} "
                    "ended: its pages are not freed into the new group"
                )
            for pool, pages in session.ledger.take_all().items():
                freed += state.free(pool, pages)
            for b in self._backups.take_session(session.session_id):
                freed += self._free_backup(b)
            index = state.index
            for pid in list(session.prefetches):
                if index is not None:
                    with contextlib.suppress(NotFound):
                        # Not waited for: a batch in flight frees its own pages when its L3 read
                        # returns, and a hung read would hold the lease reaper (every session's).
                        index.get_prefetch(pid).cancel(wait=False)
        finally:
            session.plan_layers.clear()  # it references the device views unmapped now
            session.mappings.close()
        self._observer.on_session(reason, session)
        logger.info(
            "session ended",
            extra={"event": reason, "session": session.session_id, "freed_pages": freed},
        )
        return freed

    def _free_backup(self, backup: Backup) -> int:
        return self._groups.get(backup.group_id).release_transfers(backup.transfers)

    # ------------------------------------------------------------------- admin

    def stats(self, session_id: str = "", *, own: bool = False) -> DaemonStats:
        """Everything, or one session, its group and its backups. ``own`` (a worker's view): of
        its session, the group's indexed pages and sessions count the session's tenant only;
        without one, the aggregates only (the rest is not the worker's to see, nor to build)."""
        sessions = [self._sessions.get(session_id)] if session_id else self._sessions.all()
        groups = self._groups.all()
        if session_id:
            groups = [g for g in groups if g.group_id == sessions[0].group_id]
        tenant = sessions[0].worker.tenant if own and session_id else None
        backups = self._backups.snapshot(session_id)
        if own and not session_id:  # before the per-session and per-group stats are built
            sessions, groups, backups = [], [], []
        return DaemonStats(
            sessions=tuple(s.stats() for s in sessions),
            groups=tuple(
                GroupStats(
                    g.group_id,
                    g.model_name,
                    g.states(),
                    0 if g.index is None else g.index.stats(tenant).entries,
                    self._sessions.in_group(g.group_id, tenant),
                    0 if tenant is not None else self._sessions.holds(g.group_id),
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

    def retraction_backups(self) -> int:
        """How many retraction backups are held now (cheap: a count under the store's lock)."""
        return len(self._backups)

    def live_session_ids(self) -> frozenset[str]:
        """Ids of the sessions alive now (no lease is touched)."""
        return frozenset(s.session_id for s in self._sessions.all())

    def check_secret(self, session_id: str, secret: str) -> None:
        """PermissionDenied unless ``secret`` is session ``session_id``'s secret (unknown ids pass)."""
        self._sessions.check_secret(session_id, secret)

    def anchor_pool(self, session_id: str) -> str:
        """The name of the anchor pool of session ``session_id``'s group (NotFound for unknown ids)."""
        return self._data.session(session_id)[1].group.anchor.name

    def session_worker(self, session_id: str) -> WorkerId:
        """The worker identity session ``session_id`` attached with (NotFound for unknown ids)."""
        return self._data.session(session_id)[0].worker

    def session_origin(self, session_id: str) -> str:
        """Who attached ``session_id`` (the servicer's peer key), or "" in process; NotFound if unknown."""
        return self._data.session(session_id)[0].origin

    def session_group(self, session_id: str) -> tuple[Session, GroupState]:
        """For the content-cache operations (``hicached.core.keyed``)."""
        return self._data.session(session_id)

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

    def close(self, wait_s: float | None = None) -> None:
        """End every session (freeing their pages), then release the groups (journaled under warm
        restart); in-flight work gets ``wait_s`` (default ``server.grace_s``) for all sessions together."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (self._cfg.server.grace_s if wait_s is None else wait_s)
        for session in self._sessions.all():
            self._end(session, "shutdown", wait_s=max(0.0, deadline - time.monotonic()))
        for b in self._backups.take_all():
            self._free_backup(b)
        with self._teardowns:  # a page is freed by its teardown or by its group's close, never both
            self._groups_closed = True
            self._teardowns.wait_for(lambda: self._tearing == 0)
        self._groups.close()


__all__ = ["HiCacheCore", "PoolRole"]
