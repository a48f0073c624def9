"""Host pool groups shared by the workers of one model/layout, within one budget.

A group is keyed by what must match for two workers to share host pages: the
model, the TP/PP position (MLA pools are identical on every TP rank, so an
all-MLA group ignores the TP rank) and the exact pool specs. A restarted or
replicated worker with the same key re-joins the group, so its warm L2 pages
(and the content index over them) outlive the worker.

With ``host.warm_restart`` the pools also outlive the daemon: segments get
deterministic names, a clean shutdown journals each group's content index
(:mod:`hicached.core.journal`) and keeps the segments, and the next daemon
re-maps them when a worker recreates the group. Until then they are journaled
groups (:mod:`hicached.core.warm`), counted against the budget and the group count.

A new group is built before anything makes room for it: the idle groups it would
replace are only chosen, and retired once it is built and has its index. A build that
fails leaves the registry as it was and frees what it made, so every group is closed
exactly once (before, the chosen groups had already left the registry and were never
closed: their segments and index threads leaked).

Thread-safety: ``GroupRegistry`` has one lock for its map, its journaled groups and the budget;
``GroupState`` has one lock for the in-flight page counts that defer frees. The
registry's ``tenant_keys`` (thread-safe, its own lock) is shared by every group's index.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from hicached.config import HostConfig
from hicached.core.attach_checks import validate_pool_requests, validate_worker
from hicached.core.footprint import bookkeeping_bytes, entry_bytes
from hicached.core.group_state import GroupState
from hicached.core.journal import GroupJournal, JournalStore
from hicached.core.types import PoolRequest, PoolRole, WorkerId
from hicached.core.warm import Journaled, WarmGroups
from hicached.errors import (
    FailedPrecondition,
    HiCacheError,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    ResourceExhausted,
    clip,
)
from hicached.index.tenant_keys import TenantL3Keys
from hicached.l2.group import HostPoolGroup, PoolEntry
from hicached.l2.host_pool import HostKVPool, create_host_pool
from hicached.l2.layout import PoolKind, host_pages_for
from hicached.l2.owners import OwnerRecord, reclaim_dead
from hicached.shm import MAX_NAME_BYTES, name_is_valid

logger = logging.getLogger(__name__)

# Per pool of an attach: its request, its usable pages, what it costs host.budget.
_Plan = list[tuple[PoolRequest, int, int]]


def group_key(worker: WorkerId, pools: Sequence[PoolRequest]) -> tuple[object, ...]:
    all_mla = all(p.spec.kind is PoolKind.MLA for p in pools)
    tp = (0, 0) if all_mla else (worker.tp_rank, worker.tp_size)
    return (
        worker.model_name,
        tp,
        (worker.pp_rank, worker.pp_size),
        tuple(sorted(p.signature() for p in pools)),
    )


def group_id_for(key: tuple[object, ...]) -> str:
    """Stable across daemon restarts (it namespaces L3 keys)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]


def _layer_mapper(layer_ids: Sequence[int], num_layers: int) -> Callable[[int], int | None]:
    ids = list(layer_ids) if layer_ids else list(range(num_layers))
    table = {g: i for i, g in enumerate(ids) if g >= 0}
    return table.get


def _check_join(state: GroupState, plan: Sequence[tuple[PoolRequest, int, int]]) -> None:
    """A joining worker gets the group's pools; refuse one that asks for more host pages.

    Asking for fewer is fine (the worker gets more than it asked for). Asking
    for more would silently give it the smaller pool, so it is refused.
    """
    for p, pages, _ in plan:
        have = state.pool(p.name).num_pages
        if pages > have:
            raise FailedPrecondition(
                f"pool {p.name!r} asks for {pages} host pages but pool group {state.group_id} already exists "
                f"with {have} and in use (sessions attached, or ending once their calls in flight "
                f"return, as `hicached status` counts them); attach with at most {have} pages, or end every "
                "session of the group (detach, or let the leases expire): the next attach then recreates "
                "it at the new size"
            )


class GroupRegistry:
    """Creates, finds and retires pool groups within the node's host budget."""

    def __init__(self, host: HostConfig, *, daemon_id: str, max_key_bytes: int) -> None:
        """``max_key_bytes`` (``limits.max_key_bytes``) sizes what the budget charges for each
        content-index entry a group may hold (:func:`hicached.core.footprint.entry_bytes`)."""
        self._host = host
        self._budget = host.budget_bytes()
        self._max_key_bytes = max_key_bytes
        self._daemon_id = daemon_id
        self._lock = threading.Lock()
        self._groups: dict[str, GroupState] = {}
        # A copy of _groups made under the lock after each change, read without it: building
        # a group holds the lock for seconds (its pools are reserved and populated), and the
        # event loop looks groups up for every page call and gauge refresh.
        self._view: dict[str, GroupState] = {}
        # And the bytes of the group being built (one at a time: builds hold the lock), which
        # used_bytes counts before the group is published (its memory is taken from the
        # start): published with the view as one pair, so no reader counts a group twice.
        self._counted: tuple[dict[str, GroupState], int] = ({}, 0)
        # The keys of each tenant that the groups' indexes wrote to L3 (for a tenant clear):
        # one store for all groups, so its bound is the daemon's, not one per group.
        self.tenant_keys = TenantL3Keys()
        self._journals: JournalStore | None = None
        self._warm: WarmGroups | None = None
        if host.warm_restart:
            self._journals = JournalStore(host.journal_dir, host.shm_prefix, max_key_bytes=max_key_bytes)
            self._warm = WarmGroups(self._journals, prefault=host.prefault)
            self._warm.start(budget=self._budget, max_groups=host.max_groups)
        # Cold-mode segments carry their daemon's id; its locked record proves it alive, and
        # the records of dead daemons of this prefix (a SIGKILL leaves them) free theirs now.
        # Warm-restart names carry no daemon id: the journal lock above owns those.
        reclaim_dead(host.shm_prefix)
        self._owner = None if host.warm_restart else OwnerRecord(host.shm_prefix, daemon_id)

    def _segment_name(self, gid: str, pool: str) -> str:
        if self._warm is not None:
            return self._warm.segment_name(gid, pool)
        return f"{self._host.shm_prefix}-{self._daemon_id}-{gid}-{pool}"

    def _check_segment_names(self, gid: str, pools: Sequence[PoolRequest]) -> None:
        """InvalidArgument for a pool name that cannot be part of its segment's name, before
        anything is retired or built (the segment would be refused only after that)."""
        room = MAX_NAME_BYTES - len(self._segment_name(gid, "").encode())
        for p in pools:
            if not name_is_valid(self._segment_name(gid, p.name)):
                raise InvalidArgument(
                    f"pool name {clip(p.name)} cannot be part of a host segment name: use at most "
                    f"{room} UTF-8 bytes (what host.shm_prefix and the group id leave of "
                    f"{MAX_NAME_BYTES}) and no '/' or NUL"
                )

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def used_bytes(self) -> int:
        """Bytes of the budget taken: live groups' and journaled groups' (warm restart), read
        without the registry's lock (GetStats answers during a build): a group being built or
        re-mapped counts from the start of its build."""
        warm = self._warm.nbytes() if self._warm else 0
        groups, building = self._counted
        return sum(g.nbytes for g in groups.values()) + building + warm

    def journaled_groups(self) -> int:
        """Journaled groups (warm restart) not re-created yet; read without the lock."""
        return self._warm.count() if self._warm else 0

    def get(self, group_id: str) -> GroupState:
        """Never waits for the registry's lock (a group being built; see ``_view``)."""
        state = self._view.get(group_id)
        if state is None:
            raise NotFound(f"unknown pool group {group_id!r}")
        return state

    def all(self) -> list[GroupState]:
        """Never waits for the registry's lock (see :meth:`get`)."""
        return list(self._view.values())

    def _published(self, building: int = 0) -> None:
        """After a change of ``_groups`` or of what a build takes (under the lock): the
        lock-free readers see it."""
        self._view = dict(self._groups)
        self._counted = (self._view, building)

    def get_or_create(
        self,
        worker: WorkerId,
        pools: Sequence[PoolRequest],
        *,
        idle: Callable[[str], bool],
        claim: Callable[[str], None],
        on_create: Callable[[GroupState], None],
        join_only: bool = False,
    ) -> tuple[GroupState, bool]:
        """The group for these pools and whether it already existed.

        ``idle(group_id)`` tells whether nobody uses a group (it may then be
        retired to make room); ``claim(group_id)`` is called with the group
        returned, under the lock that every ``idle`` judgement here takes, so
        that the caller's use of it counts before another attach can judge it
        idle. ``on_create`` attaches the content index. With ``join_only`` a
        group that does not exist (or could only be joined by recreating it
        larger) is NotFound, and nothing changes.
        """
        validate_worker(worker)
        validate_pool_requests(pools)
        key = group_key(worker, pools)
        gid = group_id_for(key)
        self._check_segment_names(gid, pools)
        plan = self._plan(pools)  # sizes are checked on a join too (a NaN ratio is refused either way)
        with self._lock:
            existing = self._groups.get(gid)
            if existing is not None:
                try:
                    _check_join(existing, plan)
                except FailedPrecondition as exc:
                    if join_only:
                        raise NotFound(f"{exc}; join_only does not recreate it") from None
                    if not idle(gid):
                        raise
                else:
                    existing.last_used = time.monotonic()
                    claim(gid)
                    return existing, True
            if join_only:
                raise NotFound(
                    f"no pool group of model {clip(worker.model_name)} with this pool layout (group "
                    f"{gid}); attach without join_only to create it"
                )
            need = sum(nbytes for _, _, nbytes in plan)
            # Room is found (or refused) with the smaller group still in place, so a refused
            # attach leaves it and its cached pages as they were.
            retired, dropped = self._make_room(gid, plan, idle, replacing=existing)
            if existing is not None:
                # Nobody uses the smaller group: recreate it at the new size (its segment names
                # are reused, so it is closed first; its cached pages are dropped, and a build
                # that fails now -- shared memory exhausted -- leaves neither group).
                logger.info("pool group %s is recreated with larger host pools", gid)
                del self._groups[gid]
                self._published()
                existing.close()
            self._published(building=need)
            try:
                state, journal = self._build(gid, worker.model_name, pools, plan)
            except BaseException:
                self._published()
                raise
            try:
                on_create(state)
                restored = journal is not None and self._restore(state, journal)
            except BaseException:
                self._published()
                state.close()  # its index (if made) and pools; nothing was retired yet
                raise
            # Built: only now do the groups it replaces leave (nobody can join them meanwhile:
            # joins take this lock).
            for old in retired:
                del self._groups[old.group_id]
                logger.info("retired idle pool group %s to make room", old.group_id)
            for j in dropped:
                assert self._warm is not None
                self._warm.drop(j.group_id, f"to make room for pool group {gid}")
            self._groups[gid] = state
            self._published()
            claim(gid)
        for old in retired:
            try:
                old.close()  # outside the lock: an index close waits for its L3 writes
            except Exception:  # the new group is built and claimed: the attach goes on
                logger.exception("closing retired pool group %s failed", old.group_id)
        logger.info(
            "%s pool group %s for model %r (%d bytes)",
            "re-mapped" if restored else "created",
            gid,
            worker.model_name,
            need,
        )
        return state, restored

    def _plan(self, pools: Sequence[PoolRequest]) -> _Plan:
        by_name = {p.name: p for p in pools}
        pages: dict[str, int] = {}

        def pages_of(p: PoolRequest) -> int:
            if p.name in pages:
                return pages[p.name]
            if p.role is PoolRole.DERIVED:
                # Same page ids as the source, so the same page count.
                n = pages_of(by_name[p.indices_from_pool])
            else:
                device_tokens = 0 if p.byte_only else p.k_buffers[0].shape[0]
                ratio = p.host_ratio if p.host_bytes is None else None
                if ratio is None and p.host_bytes is None:
                    ratio = self._host.default_ratio
                n = host_pages_for(p.spec, device_tokens=device_tokens, ratio=ratio, nbytes=p.host_bytes)
            pages[p.name] = n
            return n

        allocating = sum(1 for p in pools if p.role is not PoolRole.DERIVED)
        return [(p, pages_of(p), self._cost(p, pages_of(p), allocating)) for p in pools]

    def _cost(self, p: PoolRequest, pages: int, allocating_pools: int) -> int:
        """What pool ``p`` of ``pages`` pages costs the budget: its segment, the per-page
        arrays, and for the anchor the content-index entries the group may hold (one per
        anchor page at most). See :mod:`hicached.core.footprint`."""
        nbytes = HostKVPool.required_bytes(p.spec, p.layout, pages)
        nbytes += bookkeeping_bytes(pages, allocating=p.role is not PoolRole.DERIVED)
        if p.role is PoolRole.ANCHOR:
            nbytes += pages * entry_bytes(allocating_pools, self._max_key_bytes)
        return nbytes

    def _make_room(
        self, gid: str, plan: _Plan, idle: Callable[[str], bool], *, replacing: GroupState | None = None
    ) -> tuple[list[GroupState], list[Journaled]]:
        """The groups to retire so that group ``gid`` of ``plan`` fits the budget and the
        count (``host.max_groups``: each group also costs a descriptor and memory maps, which a
        budget of bytes alone did not bound): journaled groups first, oldest first (nobody has
        used them since the last daemon stopped), then least recently used idle groups.

        Only chosen: the caller retires them once the new group is built. ``gid``'s own
        journal is not counted (its bytes are the plan's), nor the group the new one
        ``replacing`` (an idle smaller group of the same id). ResourceExhausted or LimitExceeded
        when even all of them would not make room."""
        need = sum(nbytes for _, _, nbytes in plan)
        journaled = [j for j in self._warm.oldest_first() if j.group_id != gid] if self._warm else []
        others = [g for g in self._groups.values() if g is not replacing]
        used = sum(g.nbytes for g in others) + sum(j.nbytes for j in journaled)
        count, most = len(others) + len(journaled) + 1, self._host.max_groups
        retired: list[GroupState] = []
        dropped: list[Journaled] = []

        def fits() -> bool:
            return used + need <= self._budget and count <= most

        for j in journaled:
            if fits():
                break
            dropped.append(j)
            used -= j.nbytes
            count -= 1
        for g in sorted(others, key=lambda g: g.last_used):
            if fits():
                break
            if idle(g.group_id):
                retired.append(g)
                used -= g.nbytes
                count -= 1
        if used + need > self._budget:
            segments = sum(HostKVPool.required_bytes(p.spec, p.layout, n) for p, n, _ in plan)
            pages = sum(n for _, n, _ in plan)
            raise ResourceExhausted(
                f"host pools need {need} bytes ({segments} of shared memory, {need - segments} of "
                f"the daemon's bookkeeping for their {pages} pages, ~{(need - segments) // max(pages, 1)} "
                f"bytes each) but only {max(self._budget - used, 0)} of the host.budget={self._budget} "
                "bytes are free; lower the pools' host_size, use larger pages, or raise host.budget"
            )
        if count > most:
            raise LimitExceeded(
                f"{count - 1} pool groups are in use (sessions attached, or ending once their calls "
                f"in flight return), the most host.max_groups={most} allows: detach the sessions "
                "of a model no longer served, or raise host.max_groups",
                "host.max_groups",
            )
        return retired, dropped

    def _restore(self, state: GroupState, journal: GroupJournal) -> bool:
        """Replay the journal's entries into the new index; False (logged) leaves the group cold."""
        if state.index is None:
            logger.warning("pool group %s has no content index; its journal is dropped", state.group_id)
            return False
        try:
            restored = state.index.restore(journal.entries)
        except HiCacheError as exc:
            logger.warning(
                "pool group %s: journal replay refused (%s); starting it cold", state.group_id, exc
            )
            return False
        logger.info("pool group %s: restored %d cached pages after a warm restart", state.group_id, restored)
        return True

    def _build(
        self, gid: str, model: str, pools: Sequence[PoolRequest], plan: _Plan
    ) -> tuple[GroupState, GroupJournal | None]:
        """A new group (its journal when its pools were re-mapped from one)."""
        taken = self._warm.take(gid, plan) if self._warm is not None else None
        journal, reopened = taken if taken is not None else (None, None)
        group = HostPoolGroup()
        created: list[HostKVPool] = []
        try:
            for i, (p, num_pages, _) in enumerate(plan):
                if reopened is not None:
                    pool = reopened[i]
                else:
                    pool = create_host_pool(
                        p.spec,
                        p.layout,
                        num_pages,
                        segment_name=self._segment_name(gid, p.name),
                        prefault=self._host.prefault,
                    )
                created.append(pool)
                group.add_entry(
                    PoolEntry(
                        name=p.name,
                        host_pool=pool,
                        layer_mapper=_layer_mapper(p.layer_ids, p.spec.num_layers),
                        is_primary_index_anchor=p.role is PoolRole.ANCHOR,
                        indices_from_pool=p.indices_from_pool or None,
                        packed_draft_layers=p.packed_draft_layers,
                    )
                )
        except BaseException:
            for pool in (*created, *(reopened or ())[len(created) :]):
                pool.close()
                pool.unlink()
            raise
        return GroupState(
            group_id=gid,
            model_name=model,
            group=group,
            nbytes=sum(n for *_, n in plan),
            tenant_keys=self.tenant_keys,
        ), journal

    def close(self) -> None:
        """Release every group (shutdown: sessions have ended). Under warm restart each
        group is journaled and its segments kept; then the prefix is released."""
        with self._lock:
            # Least recently used first: the next daemon drops the oldest journals first.
            states = sorted(self._groups.values(), key=lambda g: g.last_used)
            self._groups.clear()
            self._published()
        # Every journal is written before any index closes: closing an index waits for
        # its L3 writes, which a stalled store can hold past the pod's grace period.
        journals = self._journals
        kept = [journals is not None and s.save(journals) for s in states]
        for s, saved in zip(states, kept, strict=True):
            s.close(saved)
        if self._owner is not None:
            self._owner.release()
        if self._warm is not None:
            self._warm.unlock()
