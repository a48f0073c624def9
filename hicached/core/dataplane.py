"""The data plane of the core: request checks, host-page bookkeeping and page copies.

:class:`DataPlane` is the room of :class:`hicached.core.service.HiCacheCore` that moves
and books pages for one session's request (Alloc/Free/Resolve/Release, Write, Load);
the facade owns the state it reads (sessions, groups, engine, config). Atomicity and
ownership: see :mod:`hicached.core.service`. Thread-safe as the facade is.

The fixed cost of a call is kept small (docs/performance.md): the copy runs on the
calling thread when the engine has a free slot (``CopyEngine.run``), the plan reuses the
session's checked layer views (``Session.plan_layers``), and the op-id digest hashes page
arrays in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np

from hicached.config import Config
from hicached.core.checks import bind_derived, check_indices, check_owned, check_transfers, known_pool
from hicached.core.group_state import GroupState
from hicached.core.groups import GroupRegistry
from hicached.core.observer import CoreObserver
from hicached.core.sessions import Session, SessionTable
from hicached.core.types import Ack, TransferResult
from hicached.errors import InvalidArgument, PermissionDenied, clip
from hicached.l2.allocator import as_page_array
from hicached.l2.group import PoolTransfer
from hicached.transfer.engine import CopyEngine, Priority
from hicached.transfer.plan import Direction, build_plan

LayerCallback = Callable[[int], None]


class DataPlane:
    """Page operations of one session's requests.

    Thread-safe: it keeps no state of its own; it reads the session table, the pool groups
    and the copy engine it is given (each locks its own state) and reports copies to
    ``observer``. Built by :class:`hicached.core.service.HiCacheCore`, which owns those parts.
    """

    def __init__(
        self,
        config: Config,
        *,
        groups: GroupRegistry,
        engine: CopyEngine,
        sessions: SessionTable,
        observer: CoreObserver,
    ) -> None:
        self._cfg = config
        self._groups = groups
        self._engine = engine
        self._sessions = sessions
        self._observer = observer

    # ------------------------------------------------------------ request checks

    def session(self, session_id: str) -> tuple[Session, GroupState]:
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
        owned: Sequence[PoolTransfer] = (),
    ) -> tuple[Ack, ...]:
        """Copy ``transfers``' pages; ``owned``: transfers whose host pages the session gave
        (Write, Load), checked again once they are marked in flight (a Free meanwhile may have
        handed them to another session; from the mark on, a Free waits for the copy)."""
        items = []
        busy = []
        for t in transfers:
            if t.host_indices is None or t.device_indices is None or len(t.device_indices) == 0:
                continue
            items.append((session.views[t.name], state.pool(t.name), t.device_indices, t.host_indices))
            # Marked under the pool that owns the pages: a derived pool's page is its source's,
            # and a Free (of the source's pages) must wait for this copy too.
            busy.append((state.group.get_entry(t.name).indices_from_pool or t.name, t.host_indices))
        plan = build_plan(direction, items, cache=session.plan_layers)
        state.acquire(busy)
        try:
            if owned:
                check_owned(session, state, owned)
            result = self._engine.run(
                plan, priority=priority, owner=session.session_id, on_layer=on_layer, cancel=session.cancel
            )
        finally:
            state.release(busy)
        self._observer.on_copy(direction, plan, result.seconds, model=state.model_name)
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
        self, session: Session, state: GroupState, transfers: Sequence[PoolTransfer], *, copy_in: bool
    ) -> TransferResult:
        """Allocate missing host pages across the group (atomic). ``copy_in``: the caller copies
        the device pages in, so they need no zeroing (:meth:`PoolGroup.resolve_all`), and they
        are nobody's until then: the caller gives them to the session once filled (:meth:`own`)
        or frees them as anyone's. Until filled they hold an earlier owner's bytes, which a Free
        or Publish of the session meanwhile would hand on. Else the session owns them now."""
        result = state.group.resolve_all(list(transfers), copy_in=copy_in, owner=session.serial)
        if not result.ok:
            return TransferResult(ok=False, reason=result.reason)
        if not copy_in:
            self.own(session, fresh_of(result.transfers))
        return TransferResult(ok=True, transfers=tuple(result.transfers))

    @staticmethod
    def own(session: Session, transfers: Iterable[PoolTransfer]) -> None:
        """Give ``transfers``' pages to the session, all or none (FailedPrecondition once its
        ledger closed: the caller frees them then)."""
        session.ledger.give((t.name, t.host_indices) for t in transfers if t.host_indices is not None)

    @staticmethod
    def disown(session: Session, pages: Iterable[tuple[str, np.ndarray]]) -> None:
        """Take ``pages`` (pool, pages) out of the session's ledger before they are freed or
        published: PermissionDenied, nothing changed, unless the session owns every one.

        Before, not after: once given away a page may come back to this session through a
        concurrent Alloc, whose ownership a later forget would erase (a leak), and a second
        call that checked the same pages must not free them again (another session's by then).
        """
        missing = session.ledger.take(pages)
        if missing is not None:
            pool, page = missing
            raise PermissionDenied(
                f"host page {page} of pool {clip(pool)} is not owned by session {session.session_id} "
                "(or no longer: another call of this session freed or published it)"
            )

    def release_owned(self, session: Session, state: GroupState, transfers: Iterable[PoolTransfer]) -> int:
        """Free the session's allocated pages of ``transfers`` (derived ones skipped by role);
        they hold only what the session may read, so they come back to it unzeroed.

        Atomic: the ledger gives the pages up first (:meth:`disown`), then
        ``state.release_transfers`` validates the whole batch before freeing;
        when it refuses, nothing was freed and the ledger owns the pages again.
        """
        owned = state.allocated_transfers(transfers)
        pages = [(t.name, np.asarray(t.host_indices, dtype=np.int64)) for t in owned]
        self.disown(session, pages)
        try:
            return state.release_transfers(owned, by=session.serial)
        except BaseException:
            session.ledger.give(pages)
            raise

    # ---------------------------------------------------------------- host pages

    def alloc(self, session_id: str, op_id: str, pool: str, num_pages: int) -> np.ndarray | None:
        session, state = self.session(session_id)
        known_pool(state, pool)
        entry = state.group.get_entry(pool)
        if entry.indices_from_pool:
            raise InvalidArgument(
                f"pool {clip(pool)} is derived from {clip(entry.indices_from_pool)}: it does not allocate"
            )
        if num_pages <= 0 or num_pages > self._cfg.server.max_batch_pages:
            raise InvalidArgument(
                f"num_pages={num_pages} must lie in [1, server.max_batch_pages={self._cfg.server.max_batch_pages}]"
            )

        def run() -> np.ndarray | None:
            got = state.group.allocate({pool: num_pages}, owner=session.serial)
            if not got.ok:
                return None
            pages = got.pages[pool]
            session.ledger.add(pool, pages)
            return pages

        return session.run("Alloc", op_id, (pool, num_pages), run)

    def free(self, session_id: str, op_id: str, pool: str, pages: Sequence[int] | np.ndarray) -> int:
        session, state = self.session(session_id)
        known_pool(state, pool)
        arr = as_page_array(pages, f"pool {clip(pool)} host pages")

        def run() -> int:
            check_indices(pool, "host", arr, state.pool(pool).num_pages)
            check_owned(session, state, [PoolTransfer(pool, arr, arr)])
            self.disown(session, [(pool, arr)])
            try:
                return state.free(pool, arr, by=session.serial)
            except BaseException:
                session.ledger.give([(pool, arr)])  # validated first: nothing was freed
                raise

        return session.run("Free", op_id, (pool, arr), run)

    def resolve(self, session_id: str, op_id: str, transfers: Sequence[PoolTransfer]) -> TransferResult:
        session, state = self.session(session_id)
        checked = self.check_transfers(session, state, transfers)

        def run() -> TransferResult:
            check_owned(session, state, checked)  # inside: a replay must not re-check
            return self.allocate(session, state, checked, copy_in=False)

        return session.run("ResolveTransfers", op_id, checked, run)

    def release(self, session_id: str, op_id: str, transfers: Sequence[PoolTransfer]) -> int:
        session, state = self.session(session_id)
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
        session, state = self.session(session_id)
        checked = self.check_transfers(session, state, transfers, host="optional" if allocate else "required")
        if not allocate:
            checked = bind_derived(state, checked)

        def run() -> TransferResult:
            check_owned(session, state, checked)  # a stranger's pages are never marked in flight
            resolved = (
                self.allocate(session, state, checked, copy_in=True)
                if allocate
                else TransferResult(True, tuple(checked))
            )
            if not resolved.ok:
                return resolved
            fresh: list[PoolTransfer] = []  # pages this call allocated (in input order)
            given: list[PoolTransfer] = []
            for asked, got in zip(checked, resolved.transfers, strict=True):
                (fresh if asked.host_indices is None and got.host_allocated else given).append(got)
            try:
                acks = self.copy_pages(
                    session, state, Direction.D2H, resolved.transfers, priority=Priority.DEMAND, owned=checked
                )
                self.own(session, fresh)
            except BaseException:
                # Pages this call allocated are nobody's yet, and a part of them may still hold
                # an earlier owner's bytes: freed as anyone's (zeroed for whoever is next).
                state.release_transfers(fresh)
                if given:
                    self.release_owned(session, state, given)
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
        session, state = self.session(session_id)
        checked = bind_derived(state, self.check_transfers(session, state, transfers, host="required"))

        def run() -> tuple[Ack, ...]:
            check_owned(session, state, checked)  # a stranger's pages are never marked in flight
            return self.copy_pages(
                session,
                state,
                Direction.H2D,
                checked,
                priority=Priority.DEMAND,
                on_layer=on_layer,
                owned=checked,
            )

        return session.run("Load", op_id, checked, run)


def fresh_of(transfers: Iterable[PoolTransfer]) -> list[PoolTransfer]:
    """The transfers whose host pages an allocation made (``host_allocated``, with pages)."""
    return [t for t in transfers if t.host_allocated and t.host_indices is not None]
