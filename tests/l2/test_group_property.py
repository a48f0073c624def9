"""Property test: random alloc/free/resolve/release across pools, with injected failures.

After every step, for every pool: free + allocated == capacity, and the
allocator's allocated pages are exactly the pages the model says someone owns
(no leak, no page owned twice). Releasing anything twice is a DoubleFree that
changes nothing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicached.errors import DoubleFree
from hicached.l2 import HostLayout, HostPoolGroup, PoolEntry, PoolTransfer, create_host_pool

from .conftest import PoolReclaimer, mha_spec

POOLS = {"kv": 12, "swa": 6, "mamba": 9}
DERIVED = "draft"  # reuses the anchor's ("kv") pages


class InjectedFailure(Exception):
    pass


class GroupMachine(RuleBasedStateMachine):
    @initialize()
    def build(self) -> None:
        tag = f"hicached-prop-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        pools = {
            name: create_host_pool(
                mha_spec(layers=1, heads=1, head_dim=2, page_size=1),
                HostLayout.PAGE_FIRST,
                n,
                segment_name=f"{tag}-{name}",
                prefault=False,
            )
            for name, n in {**POOLS, DERIVED: POOLS["kv"]}.items()
        }
        self.pools = pools
        self.group = HostPoolGroup(
            [
                PoolEntry("kv", pools["kv"], is_primary_index_anchor=True),
                PoolEntry("swa", pools["swa"]),
                PoolEntry("mamba", pools["mamba"]),
                PoolEntry(DERIVED, pools[DERIVED], indices_from_pool="kv"),
            ]
        )
        self.group.register_reclaimer(PoolReclaimer({name: self._reclaimer(name) for name in POOLS}))
        self.held: dict[str, list[np.ndarray]] = {name: [] for name in POOLS}
        self.resolved: list[list[PoolTransfer]] = []
        self.released: list[list[PoolTransfer]] = []
        self.failing: set[str] = set()

    def _reclaimer(self, name: str) -> Callable[[int], int]:
        def reclaim(need: int) -> int:
            if name in self.failing:
                raise InjectedFailure(name)
            freed = 0
            while freed < need and self.held[name]:
                freed += self.group.free(self.held[name].pop(0), pool=name)
            return freed

        return reclaim

    def teardown(self) -> None:
        if hasattr(self, "group"):
            self.group.close()
            for pool in self.pools.values():
                pool.unlink()

    def _owned(self, name: str) -> list[int]:
        pages = [int(p) for arr in self.held[name] for p in arr]
        for transfers in self.resolved:
            for t in transfers:
                if t.name == name and t.host_allocated and t.host_indices is not None:
                    pages.extend(int(p) for p in t.host_indices)
        return pages

    def _snapshot(self) -> dict[str, list[int]]:
        return {n: self.group.get_pool(n).allocator.allocated_pages().tolist() for n in POOLS}

    @rule(name=st.sampled_from(sorted(POOLS)), n=st.integers(0, 7))
    def alloc(self, name: str, n: int) -> None:
        before = self.group.available(name)
        pages = self.group.alloc(n, pool=name)
        if pages is None:
            assert n > before
        else:
            assert pages.size == n
            self.held[name].append(pages)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([n for n in POOLS if self.held[n]]))
        arr = self.held[name].pop(data.draw(st.integers(0, len(self.held[name]) - 1)))
        assert self.group.free(arr, pool=name) == arr.size

    @rule(
        sizes=st.fixed_dictionaries({n: st.integers(0, 8) for n in POOLS}),
        present=st.sets(st.sampled_from([*POOLS, DERIVED]), min_size=1),
    )
    def resolve(self, sizes: dict[str, int], present: set[str]) -> None:
        transfers = [
            PoolTransfer(n) if n == DERIVED else PoolTransfer(n, np.arange(sizes[n], dtype=np.int64))
            for n in sorted(present)
        ]
        before = self._snapshot()
        evictable = any(self.held.values())  # reclaim may legitimately evict these
        try:
            result = self.group.resolve_all(transfers)
        except InjectedFailure:
            event("resolve: injected reclaim failure")
            # Only successful reclaims (which updated the model) may have changed anything.
            self._check_matches_model()
            return
        event(f"resolve: {'ok' if result.ok else 'no room, rolled back'}")
        if result.ok:
            self.resolved.append(result.transfers)
            for t in result.transfers:
                if t.name in POOLS:
                    assert t.host_indices is not None and t.host_indices.size == sizes[t.name]
            if DERIVED in present:
                kv = next((t for t in result.transfers if t.name == "kv"), None)
                draft = next(t for t in result.transfers if t.name == DERIVED)
                assert not draft.host_allocated
                if kv is not None:
                    assert draft.host_indices is not None and kv.host_indices is not None
                    assert draft.host_indices.tolist() == kv.host_indices.tolist()
        else:
            assert result.reason
            assert all(t.host_indices is None and not t.host_allocated for t in result.transfers)
            if not evictable:
                assert self._snapshot() == before

    @precondition(lambda self: self.resolved)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        transfers = self.resolved.pop(data.draw(st.integers(0, len(self.resolved) - 1)))
        expected = sum(
            t.host_indices.size for t in transfers if t.host_allocated and t.host_indices is not None
        )
        assert self.group.release_transfers(transfers) == expected
        self.released.append(transfers)

    def _has_free_page(self, transfers: list[PoolTransfer]) -> bool:
        """True if releasing ``transfers`` again must be caught: one of its pages is free now.

        (Once every page has been handed out again, the indices name someone
        else's pages; no index-based allocator, the reference's included, can
        tell that apart from a legitimate free.)
        """
        return any(
            not self.group.get_pool(t.name).allocator.is_allocated(t.host_indices).all()
            for t in transfers
            if t.host_allocated and t.host_indices is not None and t.host_indices.size
        )

    @precondition(lambda self: any(self._has_free_page(ts) for ts in self.released))
    @rule(data=st.data())
    def release_again(self, data: st.DataObject) -> None:
        candidates = [ts for ts in self.released if self._has_free_page(ts)]
        transfers = candidates[data.draw(st.integers(0, len(candidates) - 1))]
        before = self._snapshot()
        try:
            self.group.release_transfers(transfers)
        except DoubleFree:
            event("second release caught")
        else:
            raise AssertionError("a second release was not detected")
        assert self._snapshot() == before

    @rule(name=st.sampled_from(sorted(POOLS)))
    def toggle_failure(self, name: str) -> None:
        self.failing ^= {name}

    @invariant()
    def capacity_is_conserved(self) -> None:
        if not hasattr(self, "group"):
            return
        for name, capacity in {**POOLS, DERIVED: POOLS["kv"]}.items():
            allocator = self.group.get_pool(name).allocator
            assert allocator.available() + allocator.allocated_count() == capacity
        assert self.group.available(DERIVED) == POOLS["kv"]  # derived pools never allocate
        self._check_matches_model()

    def _check_matches_model(self) -> None:
        for name in POOLS:
            owned = self._owned(name)
            assert len(owned) == len(set(owned)), f"{name}: a page is owned twice"
            assert sorted(owned) == self.group.get_pool(name).allocator.allocated_pages().tolist()


GroupMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestGroupProperties = GroupMachine.TestCase
