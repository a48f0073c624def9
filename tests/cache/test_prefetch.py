"""L3 -> L2 prefetch: stop policies, the deadline formula, progress, cancel frees."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from hicached.errors import InvalidArgument, NotFound
from hicached.index import (
    ContentIndex,
    LookupResult,
    PrefetchPolicy,
    PrefetchState,
    PrefetchStatus,
    PrefetchTask,
    prefetch_deadline_s,
)
from hicached.l2 import HostPoolGroup
from hicached.l3 import StorageBackend, create_backend

from .conftest import PAGE_SIZE, GatedGets, Wrapped, keys_of, page_pattern, pin_bytes, write_pages

MakeGroup = Callable[..., HostPoolGroup]
MakeIndex = Callable[..., ContentIndex]


@pytest.fixture
def l3_path(tmp_path: Path) -> str:
    return str(tmp_path / "l3")


def seed_l3(make_group: MakeGroup, path: str, keys: Sequence[str], seed: int) -> None:
    """Another daemon's life: publish ``keys`` and back them up to the file backend at ``path``."""
    backend = create_backend("file", {"path": path})
    group = make_group(len(keys), derived=("draft",))
    index = ContentIndex(group, namespace="model-a", backend=backend)
    index.publish(keys, write_pages(group, len(keys), seed=seed))
    assert index.flush(timeout_s=30) == len(keys)
    index.close()
    backend.close()


@pytest.fixture
def gated(l3_path: str) -> Iterator[Callable[[], GatedGets]]:
    """Opens the file backend at ``l3_path`` behind a gate (call it after seeding L3)."""
    made: list[GatedGets] = []

    def make() -> GatedGets:
        made.append(GatedGets(create_backend("file", {"path": l3_path})))
        return made[-1]

    yield make
    for backend in made:
        backend.gate.set()
        backend.inner.close()


def wait_finished(task: PrefetchTask, timeout_s: float = 30.0) -> PrefetchStatus:
    """Block on the task's progress condition (no polling) until it leaves RUNNING."""
    deadline = time.monotonic() + timeout_s
    status = task.status()
    while status.state is PrefetchState.RUNNING:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"prefetch still running: {status}"
        status = task.next_status(status.completed_pages, remaining)
    return status


def test_deadline_formula_matches_the_reference() -> None:
    assert prefetch_deadline_s(0) == 1.0
    assert prefetch_deadline_s(1024) == 1.25
    assert prefetch_deadline_s(4096) == 2.0
    assert prefetch_deadline_s(512, base_s=0.5, per_1k_tokens_s=1.0) == 1.0
    with pytest.raises(InvalidArgument):
        prefetch_deadline_s(-1)


def test_wait_complete_brings_every_planned_page_into_l2(
    make_group: MakeGroup, make_index: MakeIndex, l3_path: str
) -> None:
    keys = keys_of("p", 10)
    seed_l3(make_group, l3_path, keys, seed=1)
    backend = Wrapped(create_backend("file", {"path": l3_path}))
    group = make_group(16, derived=("draft",))
    index = make_index(group, backend, batch_pages=4)
    # Two keys are already in L2 here: they are not planned.
    index.publish(keys[:2], write_pages(group, 2, seed=1))
    assert index.lookup([*keys, "missing"]) == LookupResult(2, 10)
    task = index.prefetch([*keys, "missing"], policy=PrefetchPolicy.WAIT_COMPLETE)
    assert task.planned_pages == 8
    assert index.get_prefetch(task.id) is task
    assert task.wait() == PrefetchStatus(PrefetchState.DONE, 8, 8)
    assert backend.get_calls == 2  # two batches of four
    assert index.lookup(keys) == LookupResult(10, 10)
    pin = index.pin(keys)
    for i in range(10):
        got = pin_bytes(group, dict(pin.pages), i)
        for entry in group.entries:
            assert got[entry.name] == page_pattern(entry.host_pool.page_bytes, 1, i, entry.name)
    index.unpin(pin)
    assert index.stats().prefetched_pages == 8
    backend.inner.close()


def test_best_effort_returns_at_once_and_keeps_going(
    make_group: MakeGroup, make_index: MakeIndex, l3_path: str, gated: Callable[[], GatedGets]
) -> None:
    keys = keys_of("b", 4)
    seed_l3(make_group, l3_path, keys, seed=2)
    backend = gated()
    index = make_index(make_group(8), backend)
    task = index.prefetch(keys, policy="best_effort")
    assert task.wait() == PrefetchStatus(PrefetchState.RUNNING, 0, 4)
    backend.gate.set()
    assert wait_finished(task) == PrefetchStatus(PrefetchState.DONE, 4, 4)
    assert index.lookup(keys).l2_hit_pages == 4


def test_timeout_uses_the_formula_and_stops_further_batches(
    make_group: MakeGroup, make_index: MakeIndex, l3_path: str, gated: Callable[[], GatedGets]
) -> None:
    keys = keys_of("t", 8)
    seed_l3(make_group, l3_path, keys, seed=3)
    backend = gated()
    index = make_index(make_group(16), backend, batch_pages=4)
    backend.gate.set()
    default = index.prefetch(keys, policy=PrefetchPolicy.TIMEOUT)
    assert default.timeout_s == prefetch_deadline_s(8 * PAGE_SIZE) == 1.0 + 0.25 * 32 / 1024
    assert default.wait() == PrefetchStatus(PrefetchState.DONE, 8, 8)
    assert index.reclaim("kv", 8) == 8
    assert index.lookup(keys) == LookupResult(0, 8)
    backend.gate.clear()
    while backend.entered.acquire(blocking=False):
        pass

    created = time.monotonic()
    task = index.prefetch(keys, policy=PrefetchPolicy.TIMEOUT, timeout_s=0.2)
    assert backend.entered.acquire(timeout=30)  # first batch is in flight and held
    status = task.wait()
    assert 0.2 <= time.monotonic() - created < 10  # waited for the deadline, not for the batch
    assert status == PrefetchStatus(PrefetchState.TIMED_OUT, 0, 8)
    calls = backend.get_calls
    backend.gate.set()
    # The batch in flight lands and is published; no further batch starts.
    final = wait_in_flight_done(task)
    assert backend.get_calls == calls
    assert final.state is PrefetchState.TIMED_OUT
    assert index.lookup(keys).l2_hit_pages == final.completed_pages == 4


def wait_in_flight_done(task: PrefetchTask) -> PrefetchStatus:
    # cancel() of a finished prefetch changes nothing and returns once no batch is in flight.
    task.cancel()
    return task.status()


def test_cancel_frees_pages_that_were_not_published(
    make_group: MakeGroup, make_index: MakeIndex, l3_path: str, gated: Callable[[], GatedGets]
) -> None:
    keys = keys_of("c", 8)
    seed_l3(make_group, l3_path, keys, seed=4)
    backend = gated()
    group = make_group(8)
    index = make_index(group, backend, batch_pages=4)
    task = index.prefetch(keys, policy=PrefetchPolicy.WAIT_COMPLETE)
    assert backend.entered.acquire(timeout=30)
    assert group.available() == 4  # the first batch's pages are allocated, being filled
    result: list[int] = []
    canceller = threading.Thread(target=lambda: result.append(task.cancel()))
    canceller.start()
    # cancel() waits for the batch in flight; it cannot have returned yet.
    assert canceller.is_alive()
    backend.gate.set()
    canceller.join(30)
    assert result == [0]
    assert task.status() == PrefetchStatus(PrefetchState.CANCELLED, 0, 8)
    assert backend.get_calls == 1
    assert group.available() == 8
    assert index.lookup(keys) == LookupResult(0, 8)


class LosesOneKey(Wrapped):
    """Reads of one content key fail (as a page deleted or corrupted after planning)."""

    def __init__(self, inner: StorageBackend, lost: str) -> None:
        super().__init__(inner)
        self.lost = lost

    def get_into(self, keys: Sequence[str], dests: Sequence[Sequence[memoryview]]) -> list[bool]:
        results = super().get_into(keys, dests)
        return [ok and not key.endswith(self.lost) for key, ok in zip(keys, results, strict=True)]


def test_a_failed_read_fails_the_prefetch_after_the_leading_run(
    make_group: MakeGroup, make_index: MakeIndex, l3_path: str
) -> None:
    keys = keys_of("m", 6)
    seed_l3(make_group, l3_path, keys, seed=5)
    backend = LosesOneKey(create_backend("file", {"path": l3_path}), lost=keys[2])
    group = make_group(8)
    index = make_index(group, backend, batch_pages=4)
    task = index.prefetch(keys, policy=PrefetchPolicy.WAIT_COMPLETE)
    assert task.wait() == PrefetchStatus(PrefetchState.FAILED, 2, 6)
    assert backend.get_calls == 1
    assert index.lookup(keys).l2_hit_pages == 2
    assert group.available() == 6  # the batch's other pages went back
    # A plan stops at the first key L3 does not have.
    backend.inner.delete([f"model-a/kv/{keys[4]}"])
    assert index.lookup(keys) == LookupResult(2, 4)
    assert index.prefetch(keys, policy="best_effort").planned_pages == 2
    backend.inner.close()


def test_prefetch_without_room_fails_and_leaks_nothing(
    make_group: MakeGroup, make_index: MakeIndex, l3_path: str
) -> None:
    keys = keys_of("n", 4)
    seed_l3(make_group, l3_path, keys, seed=6)
    backend = create_backend("file", {"path": l3_path})
    group = make_group(4)
    index = make_index(group, backend)
    pinned_keys = keys_of("held", 4)
    index.publish(pinned_keys, write_pages(group, 4, seed=7))
    index.flush(timeout_s=30)
    pin = index.pin(pinned_keys)
    task = index.prefetch(keys, policy=PrefetchPolicy.WAIT_COMPLETE)
    assert task.wait() == PrefetchStatus(PrefetchState.FAILED, 0, 4)
    assert group.available() == 0
    index.unpin(pin)
    # With the pin gone, the prefetch evicts LRU entries to make room.
    assert index.prefetch(keys, policy="wait_complete").wait() == PrefetchStatus(PrefetchState.DONE, 4, 4)
    backend.close()


def test_bad_prefetch_arguments(
    make_group: MakeGroup, make_index: MakeIndex, l3_backend: StorageBackend
) -> None:
    index = make_index(make_group(4), l3_backend)
    with pytest.raises(InvalidArgument, match="prefetch policy"):
        index.prefetch(["a"], policy="soon")
    with pytest.raises(InvalidArgument, match="timeout"):
        index.prefetch(["a"], policy="timeout", timeout_s=0)
    with pytest.raises(NotFound):
        index.get_prefetch("nope")
    task = index.prefetch(["a"], policy="wait_complete")
    assert task.wait() == PrefetchStatus(PrefetchState.DONE, 0, 0)


def test_one_tenants_flood_of_finished_prefetches_forgets_its_own_tickets(
    make_group: MakeGroup, make_index: MakeIndex, l3_backend: StorageBackend
) -> None:
    """Fails before: the index kept its last max_finished_prefetches finished tasks whoever
    started them, so a stranger's 1,030 empty prefetches (each finishes at once) made another
    tenant's ticket, finished a moment before, NOT_FOUND. Now the tenant holding the most
    finished tickets loses its oldest."""
    index = make_index(make_group(4), l3_backend, max_finished_prefetches=4)
    mine = index.prefetch(["a"], policy="best_effort", tenant="alice")
    assert mine.wait() == PrefetchStatus(PrefetchState.DONE, 0, 0)
    flood = [index.prefetch([f"k{i}"], policy="best_effort", tenant="bob") for i in range(10)]
    assert index.get_prefetch(mine.id) is mine
    kept = [t for t in flood if index.kept_prefetches({t.id})]
    assert kept == flood[-3:]  # four kept in all: alice's one and bob's newest three
