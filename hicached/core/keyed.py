"""Content-addressed operations of sessions: one ContentIndex per pool group.

The index owns published pages; sessions own what they allocate. This module
moves ownership between the two (publish), and runs the keyed copies
(PutPages, GetPages, PutBytes, GetBytes) with the core's copy engine while a
pin keeps the index from evicting the pages being read.

Tenants: a session's tenant is fixed at attach (``WorkerId.tenant``) and every
keyed call works in it, on tenant-scoped keys (:func:`hicached.core.tenants.scoped_keys`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from hicached.core.checks import check_indices
from hicached.core.group_state import GroupState
from hicached.core.keyed_types import KeyedOptions, PutResult, device_pages_at
from hicached.core.prefetch_admission import PrefetchAdmission
from hicached.core.service import HiCacheCore
from hicached.core.sessions import Session
from hicached.core.tenants import client_key, scoped_keys
from hicached.core.types import Ack
from hicached.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    clip,
)
from hicached.index.entries import check_keys
from hicached.index.index import ContentIndex
from hicached.index.types import BackupResult, LookupResult, PrefetchPolicy, PrefetchStatus
from hicached.l2.group import PoolTransfer
from hicached.transfer.engine import Priority
from hicached.transfer.plan import Direction

logger = logging.getLogger(__name__)


class KeyedCache:
    """Thread-safe (the index and the core lock their own state; ``tag_key`` is immutable).

    Owns nothing that needs closing: the indexes are closed with their groups
    (``GroupState.close``, run by the core's close). ``options``: its limits and default
    prefetch policy. ``tag_key``: the key of tenant tags (from ``l3.auth_key_file``), None
    for public tags.
    """

    def __init__(self, *, core: HiCacheCore, options: KeyedOptions, tag_key: bytes | None = None) -> None:
        self._core = core
        self._options = options
        self._tag_key = tag_key
        self._prefetches = PrefetchAdmission(
            options.max_prefetches_per_session, options.max_prefetch_keys_per_peer
        )

    @property
    def core(self) -> HiCacheCore:
        return self._core

    def _ctx(self, session_id: str) -> tuple[Session, GroupState, ContentIndex]:
        session, state = self.core.session_group(session_id)
        if state.index is None:
            raise FailedPrecondition(f"pool group {state.group_id} has no content index")
        return session, state, state.index

    def tenant(self, session_id: str) -> str:
        """The session's tenant (fixed at attach)."""
        session, _, _ = self._ctx(session_id)
        return session.worker.tenant

    def _scoped(
        self, session_id: str, keys: Sequence[str]
    ) -> tuple[Session, GroupState, ContentIndex, list[str]]:
        # The client's keys are checked before scoping, so errors quote them (not the tenant's
        # tag) and "" is refused for every tenant alike (scoped, it read "~<tag>").
        keys = check_keys(keys)
        session, state, index = self._ctx(session_id)
        return session, state, index, scoped_keys(session.worker.tenant, keys, tag_key=self._tag_key)

    def page_size(self, session_id: str) -> int:
        _, state, _ = self._ctx(session_id)
        return state.group.anchor.host_pool.page_size

    # ------------------------------------------------------------------ queries

    def lookup(self, session_id: str, keys: Sequence[str], *, per_key: bool = False) -> LookupResult:
        _, _, index, keys = self._scoped(session_id, keys)
        return index.lookup(keys, per_key=per_key)

    def publish(
        self, session_id: str, op_id: str, keys: Sequence[str], transfers: Sequence[PoolTransfer]
    ) -> tuple[int, int]:
        check_keys(keys, unique=True)  # the client's keys in the error (the index checks again)
        session, state, index, keys = self._scoped(session_id, keys)
        tenant = session.worker.tenant
        pages = self._columns(state, keys, transfers, side="host")

        def run() -> tuple[int, int]:
            # Inside: a replay must not re-check. Disowned before the index takes them: once
            # published they may be evicted and allocated to this session again meanwhile.
            self.core.data.disown(session, pages.items())
            try:
                mask = index.publish(keys, pages, tenant=tenant)
            except BaseException:
                session.ledger.give(pages.items())  # the index took nothing
                raise
            session.ledger.give((name, arr[~mask]) for name, arr in pages.items())
            return int(mask.sum()), int((~mask).sum())

        return session.run("Publish", op_id, (list(keys), pages, tenant), run)

    def _columns(
        self, state: GroupState, keys: Sequence[str], transfers: Sequence[PoolTransfer], *, side: str
    ) -> dict[str, np.ndarray]:
        """One page per key for every allocating pool, from the transfers' ``side`` indices; a
        derived pool's pages, when given, one per key too (else they default to its source's)."""
        wanted = state.owning_pools()
        names = [e.name for e in state.group.entries]
        given: dict[str, PoolTransfer] = {}
        for t in transfers:  # as every other call: a pool named twice or unknown is refused
            if t.name in given:
                raise InvalidArgument(f"pool {clip(t.name)} appears twice in one batch")
            if t.name not in names:
                raise NotFound(f"unknown pool {clip(t.name)} (pools: {names})")
            given[t.name] = t
        for t in transfers:
            arr = t.host_indices if side == "host" else t.device_indices
            if t.name not in wanted and arr is not None and 0 < len(arr) != len(keys):
                raise InvalidArgument(
                    f"pool {clip(t.name)}: {len(arr)} {side} pages for {len(keys)} keys (must match)"
                )
        missing = [p for p in wanted if p not in given]
        if missing:
            raise InvalidArgument(f"keyed calls need pages of every allocating pool; missing {missing}")
        out = {}
        for name in wanted:
            t = given[name]
            arr = t.host_indices if side == "host" else t.device_indices
            arr = np.asarray(arr if arr is not None else [], dtype=np.int64)
            if len(arr) != len(keys):
                raise InvalidArgument(
                    f"pool {clip(name)}: {len(arr)} {side} pages for {len(keys)} keys (must match)"
                )
            if side == "host":  # device pages were range-checked with their session's views
                check_indices(name, "host", arr, state.pool(name).num_pages)
            out[name] = arr
        return out

    # ------------------------------------------------------------- keyed copies

    def put_pages(
        self, session_id: str, op_id: str, keys: Sequence[str], transfers: Sequence[PoolTransfer]
    ) -> PutResult:
        """Device -> new host pages -> published; keys already cached are skipped."""
        # Before any allocation or eviction (the index's publish refuses them too, but only after
        # both: another tenant's entries would be evicted for a put that is then refused).
        check_keys(keys, unique=True)
        session, state, index, keys = self._scoped(session_id, keys)
        index.check_storable(keys)
        tenant = session.worker.tenant
        data = self.core.data
        checked = data.check_transfers(session, state, transfers, host="forbidden")
        self._columns(state, keys, checked, side="device")

        def run() -> PutResult:
            # Every key L2 holds is skipped, not only a leading run: allocating for one would
            # evict another entry (any tenant's) from a full pool, only for the index to refuse
            # its copy at publish. L3 is not asked: a put needs only what L2 holds.
            at = [i for i, held in enumerate(index.l2_resident(keys)) if not held]
            if not at:
                return PutResult(ok=True, existing_pages=len(keys))
            todo = [device_pages_at(t, at) for t in checked]
            new_keys = [keys[i] for i in at]
            resolved = data.allocate(session, state, todo, copy_in=True)
            if not resolved.ok:
                return PutResult(ok=False, reason=resolved.reason or "no host room")
            # The new pages are nobody's (DataPlane.allocate): this call holds them, frees them
            # as anyone's if the copy fails (a part may hold an earlier owner's bytes), and
            # frees what the index does not take.
            try:
                acks = data.copy_pages(
                    session, state, Direction.D2H, resolved.transfers, priority=Priority.DEMAND
                )
            except BaseException:
                state.release_transfers(resolved.transfers)
                raise
            pages = {t.name: t.host_indices for t in resolved.transfers if t.host_allocated}
            try:
                mask = index.publish(new_keys, pages, tenant=tenant)  # type: ignore[arg-type]
            except BaseException:
                state.release_transfers(resolved.transfers)
                raise
            leftovers = [
                PoolTransfer(t.name, host_indices=t.host_indices[~mask], host_allocated=True)  # type: ignore[index]
                for t in resolved.transfers
                if t.host_allocated
            ]
            state.release_transfers(leftovers)
            stored = int(mask.sum())
            return PutResult(ok=True, stored_pages=stored, existing_pages=len(keys) - stored, acks=acks)

        return session.run("PutPages", op_id, (list(keys), checked, tenant), run)

    def get_pages(
        self,
        session_id: str,
        op_id: str,
        keys: Sequence[str],
        transfers: Sequence[PoolTransfer],
        *,
        include_l3: bool,
        waiting: Callable[[], bool] | None = None,
    ) -> tuple[int, tuple[Ack, ...]]:
        """Host -> device copy of the keys' longest cached prefix.

        ``waiting`` (any thread may call it): whether the caller still waits for the answer,
        asked once the L3 read is done and before any copy. A caller that stopped waiting
        (its deadline, a closed fast lane) may already have reused its pages: Cancelled, and
        nothing is written into them (the L3 read can outlast any client's timeout)."""
        session, state, index, keys = self._scoped(session_id, keys)
        tenant = session.worker.tenant
        data = self.core.data
        checked = data.check_transfers(session, state, transfers, host="forbidden")
        self._columns(state, keys, checked, side="device")

        def run() -> tuple[int, tuple[Ack, ...]]:
            if include_l3:
                index.fetch_into_l2(keys, tenant=tenant)
                if waiting is not None and not waiting():
                    raise Cancelled("the caller stopped waiting while L3 was read: nothing was copied")
            pin = index.pin(keys)
            try:
                hit = len(pin)
                if hit == 0:
                    return 0, ()
                bound = [
                    PoolTransfer(
                        t.name,
                        device_indices=t.device_indices[:hit],  # type: ignore[index]
                        host_indices=pin.pages[state.group.get_entry(t.name).indices_from_pool or t.name],
                    )
                    for t in checked
                ]
                acks = data.copy_pages(session, state, Direction.H2D, bound, priority=Priority.DEMAND)
            finally:
                index.unpin(pin)
            return hit, acks

        return session.run("GetPages", op_id, (list(keys), checked, include_l3, tenant), run)

    def put_bytes(
        self, session_id: str, op_id: str, pages: Sequence[tuple[str, str, bytes]]
    ) -> tuple[int, int]:
        """Byte fallback: (key, pool, data) for every allocating pool of each key; keys already
        cached are skipped. Every check runs on the client's keys before any allocation or
        eviction (as in put_pages), the count first: per-page work is bounded by the batch."""
        session, state, index = self._ctx(session_id)
        tenant = session.worker.tenant
        pools = state.owning_pools()
        most = self._options.max_batch_pages
        if len(pages) > most * len(pools):
            raise InvalidArgument(
                f"{len(pages)} pages exceed server.max_batch_pages={most} keys of {len(pools)} pool(s) each"
            )
        check_keys([k for k, _, _ in pages])
        data: dict[tuple[str, str], bytes] = {}
        for key, pool, blob in pages:
            if pool not in pools:
                raise NotFound(f"unknown or derived pool {clip(pool)} (allocating pools: {pools})")
            if (key, pool) in data:
                raise InvalidArgument(f"key {clip(key)} pool {clip(pool)} given twice")
            want = state.pool(pool).page_bytes
            if len(blob) != want:
                raise InvalidArgument(
                    f"key {clip(key)} pool {clip(pool)}: {len(blob)} bytes, a page is {want}"
                )
            data[(key, pool)] = blob
        keys = list(dict.fromkeys(key for key, _ in data))  # in order, once each
        for key in keys:
            for pool in pools:
                if (key, pool) not in data:
                    raise InvalidArgument(f"key {clip(key)} lacks pool {clip(pool)}")
        if len(keys) > most:
            raise InvalidArgument(f"{len(keys)} keys exceed server.max_batch_pages={most}")
        scoped = scoped_keys(tenant, keys, tag_key=self._tag_key)
        index.check_storable(scoped)  # before any allocation or eviction

        def run() -> tuple[int, int]:
            # Keys L2 holds are skipped (as put_pages does): allocating for them would evict
            # other entries (any tenant's) from a full pool, only for publish to refuse them.
            new = [i for i, held in enumerate(index.l2_resident(scoped)) if not held]
            if not new:
                return 0, len(keys)
            # One allocation for every pool: it evicts only when all of them will then fit,
            # so a PutBytes without room leaves the pools and the index as they were.
            got = state.group.allocate(dict.fromkeys(pools, len(new)), fills=pools)
            if not got.ok:
                raise ResourceExhausted(f"no host room for {len(new)} keys: {got.reason}")
            allocated = got.pages
            try:
                for pool, arr in allocated.items():
                    host_pool = state.pool(pool)
                    for i, page in zip(new, arr.tolist(), strict=True):
                        host_pool.set_page_flat(page, data[(keys[i], pool)])
                mask = index.publish([scoped[i] for i in new], allocated, tenant=tenant)
            except BaseException:
                for pool, arr in allocated.items():
                    state.free(pool, arr)
                raise
            for pool, arr in allocated.items():
                if (~mask).any():
                    state.free(pool, arr[~mask])
            stored = int(mask.sum())
            return stored, len(keys) - stored

        return session.run("PutBytes", op_id, (list(pages), tenant), run)

    def get_bytes(
        self, session_id: str, keys: Sequence[str], *, include_l3: bool
    ) -> tuple[int, list[tuple[str, str, bytes]]]:
        """(pages of the keys' leading cached run, as GetPages counts it; (client key, pool,
        bytes) of each, every pool of each key)."""
        session, state, index, keys = self._scoped(session_id, keys)
        tenant = session.worker.tenant
        with session.operation():  # it reads the pools: a teardown (and a group retire) waits
            if include_l3:
                index.fetch_into_l2(keys, tenant=tenant)
            pin = index.pin(keys)
            try:
                out = []
                for i, key in enumerate(pin.keys):
                    for pool, arr in pin.pages.items():
                        data = state.pool(pool).get_page_flat(int(arr[i])).numpy().tobytes()
                        out.append((client_key(key), pool, data))
                return len(pin.keys), out
            finally:
                index.unpin(pin)

    # --------------------------------------------------------- prefetch/backup

    def prefetch(
        self,
        session_id: str,
        keys: Sequence[str],
        *,
        policy: PrefetchPolicy | None,
        timeout_ms: int,
        op_id: str = "",
    ) -> tuple[str, int]:
        """Start a prefetch of ``keys``: (its id, pages planned). ResourceExhausted, before
        any work, when the session already has ``limits.max_prefetches_per_session`` running
        or queued (each holds its plan, and the index's I/O threads take jobs in turn), or
        its peer's plans ``limits.max_prefetch_keys_per_peer`` keys (:mod:`.prefetch_admission`).
        ``policy`` None: ``l3.prefetch_policy``. A repeated ``op_id`` is answered the first
        one's prefetch (a retry starts no second one); not in flight: a detach does not wait
        for the plan (its end is checked below)."""
        session, _, index, keys = self._scoped(session_id, keys)
        tenant = session.worker.tenant
        chosen = policy or self._options.prefetch_policy  # None: the configured default

        def start() -> tuple[str, int]:
            with session.lock:
                running = index.running_prefetches(session.prefetches) + session.prefetches_starting
                ticket = self._prefetches.admit(session.origin, running, len(keys))
                session.prefetches_starting += 1  # counted while its plan is made, unlocked
            started: set[str] = set()
            try:
                timeout_s = timeout_ms / 1000 if timeout_ms else None
                task = index.prefetch(keys, policy=chosen, timeout_s=timeout_s, tenant=tenant)
                started.add(task.id)
                self._prefetches.started(session.origin, ticket, task)
            finally:
                self._prefetches.release(session.origin, ticket)  # no-op once started
                with session.lock:
                    session.prefetches_starting -= 1
                    # Keep only the ids the index still keeps: a session calling Prefetch forever
                    # must not grow this set (the index forgets all but its last finished ones).
                    session.prefetches = index.kept_prefetches(session.prefetches | started)
                    ended = session.cancel.is_set()
            if ended:
                # The session ended while the plan was made (L3 asked which keys it holds): its
                # teardown may have cancelled its prefetches before this one was among them.
                task.cancel(wait=False)
                raise Cancelled(f"session {clip(session_id)} ended while its prefetch was planned")
            return task.id, task.planned_pages

        body = (list(keys), str(chosen), timeout_ms, tenant)
        return session.run("Prefetch", op_id, body, start, in_flight=False)

    def _task(self, session_id: str, prefetch_id: str) -> object:
        """The session's own prefetch. Another session's id is NotFound with the words of an
        unknown one: telling them apart would confirm that an id (leaked or guessed) exists."""
        session, _, index = self._ctx(session_id)
        if prefetch_id not in session.prefetches:
            raise NotFound(f"prefetch {clip(prefetch_id)} is unknown to this session (or finished long ago)")
        return index.get_prefetch(prefetch_id)

    def prefetch_status(
        self, session_id: str, prefetch_id: str, *, wait: bool, timeout_s: float | None = None
    ) -> PrefetchStatus:
        """With ``wait``, blocks at most ``timeout_s`` and reports the state so far."""
        task = self._task(session_id, prefetch_id)
        return task.wait(timeout_s) if wait else task.status()  # type: ignore[attr-defined, no-any-return]

    def cancel_prefetch(self, session_id: str, prefetch_id: str, *, timeout_s: float | None = None) -> int:
        """Waits at most ``timeout_s`` for a batch in flight (its L3 read), then answers the
        pages published before the cancel."""
        task = self._task(session_id, prefetch_id)
        return int(task.cancel(timeout_s=timeout_s))  # type: ignore[attr-defined]

    def backup(
        self, session_id: str, keys: Sequence[str], *, wait: bool, timeout_s: float | None = None
    ) -> BackupResult:
        """With ``wait``, blocks at most ``timeout_s`` and reports what L3 stored so far."""
        _, _, index, keys = self._scoped(session_id, keys)
        return index.backup(keys, wait=wait, timeout_s=timeout_s)

    def page_bytes(self, session_id: str) -> int:
        """Bytes of one key's pages over every pool of the session's group (a GetBytes answer
        per key, for the response-size limit)."""
        _, state, _ = self._ctx(session_id)
        return sum(p.page_bytes for p in state.states())

    # -------------------------------------------------------------------- admin

    def indexes(self, model: str | None = None) -> list[ContentIndex]:
        return [
            s.index
            for s in self.core.groups.all()
            if s.index is not None and (model is None or s.model_name == model)
        ]

    def flush(self, timeout_s: float | None = None) -> int:
        """Flush queued L3 backups of every group (and, under write_back or write_through,
        every unwritten page); a group whose backups failed meanwhile (Unavailable) does not
        keep the others from their flush: its error is raised after them."""
        flushed, failed = 0, None
        for index in self.indexes():
            try:
                flushed += index.flush(timeout_s)
            except Unavailable as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
        return flushed

    def clear(self, model: str, tenant: str | None) -> tuple[int, int]:
        """Clear ``model`` (one tenant's, or every tenant's) from its pool groups live in this
        daemon: their L2 entries and their L3 namespaces. A group's id depends on its workers'
        layout, so what groups not re-created since the start left (in L3, or journaled for a
        warm restart) cannot be found: with no live group of the model where such pages may
        be, FailedPrecondition says so instead of a clear of nothing."""
        if not model:
            raise InvalidArgument("model_name must not be empty")
        indexes = self.indexes(model)
        journaled = self.core.groups.journaled_groups()
        if not indexes and (self._options.has_l3 or journaled):
            places = ["in L3"] if self._options.has_l3 else []
            if journaled:  # of any model: a journal does not say whose group it holds
                places.append(f"in the {journaled} pool groups journaled for a warm restart (of any model)")
            raise FailedPrecondition(
                f"model {clip(model)} has no pool group live in this daemon, so what its groups left "
                f"{' or '.join(places)} cannot be found (a group is known by its workers' layout): attach "
                "a worker of the model (one of each TP/PP rank), then clear again"
            )
        l2 = l3 = 0
        for index in indexes:
            a, b = index.clear(tenant)
            l2 += a
            l3 += b
        return l2, l3
