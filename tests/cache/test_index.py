"""Content index over real host pools: publish, pin from another session, eviction, tenants."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

from hicached.core.tenants import scoped_keys
from hicached.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from hicached.index import ContentIndex, IndexOptions, LookupResult, WritePolicy
from hicached.index.entries import check_keys
from hicached.l2 import HostPoolGroup, PoolTransfer
from hicached.page_keys import page_keys

from .conftest import PAGE_SIZE, keys_of, page_pattern, pin_bytes, write_pages

MakeGroup = Callable[..., HostPoolGroup]
MakeIndex = Callable[..., ContentIndex]


def test_worker_b_reuses_pages_published_by_worker_a(make_group: MakeGroup, make_index: MakeIndex) -> None:
    group = make_group(16, sidecars=("swa",), derived=("draft",))
    index = make_index(group)
    assert index.pool_names == ("kv", "swa")
    keys = keys_of("a", 5)

    # Worker A writes five pages in every pool and hands them to the index.
    pages_a = write_pages(group, 5, seed=1)
    assert index.publish(keys, pages_a, tenant="t").all()

    # Worker B, knowing only the keys, finds and pins the prefix and reads A's bytes.
    assert index.lookup([*keys, "zzz"]) == LookupResult(l2_hit_pages=5, total_hit_pages=5)
    pin = index.pin([*keys, "zzz"])
    assert pin.keys == tuple(keys)
    for name in ("kv", "swa"):
        np.testing.assert_array_equal(pin.pages[name], pages_a[name])
    for i in range(5):
        got = pin_bytes(group, dict(pin.pages), i)
        for entry in group.entries:
            assert got[entry.name] == page_pattern(entry.host_pool.page_bytes, 1, i, entry.name)
    assert index.stats().pinned_entries == 5
    index.unpin(pin)
    assert index.stats().pinned_entries == 0


def test_publish_of_cached_keys_leaves_pages_with_the_caller(
    make_group: MakeGroup, make_index: MakeIndex
) -> None:
    group = make_group(16)
    index = make_index(group)
    first = write_pages(group, 3, seed=1)
    index.publish(keys_of("k", 3), first)
    second = write_pages(group, 4, seed=2)
    mask = index.publish(keys_of("k", 4), second)
    assert mask.tolist() == [False, False, False, True]
    # The index kept its original pages; the caller still owns the three duplicates.
    pin = index.pin(keys_of("k", 4))
    np.testing.assert_array_equal(pin.pages["kv"][:3], first["kv"])
    assert pin.pages["kv"][3] == second["kv"][3]
    index.unpin(pin)
    assert group.free(second["kv"][~mask]) == 3


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda keys, pages: (["x", "x"], {"kv": pages["kv"][:2]}), InvalidArgument),
        (lambda keys, pages: (keys, {"kv": pages["kv"][:2]}), InvalidArgument),
        (lambda keys, pages: (keys, {"kv": pages["kv"], "nope": pages["kv"]}), NotFound),
        (lambda keys, pages: (keys, {}), InvalidArgument),
        (lambda keys, pages: (keys, {"kv": np.array([15, 14, 13])}), FailedPrecondition),
        (lambda keys, pages: (keys, {"kv": np.array([0, 0, 1])}), InvalidArgument),
        (lambda keys, pages: (keys, {"kv": np.array([0, 1, 99])}), InvalidArgument),
        (lambda keys, pages: (["ok", "a/b", "c"], pages), InvalidArgument),
        (lambda keys, pages: (["ok", "", "c"], pages), InvalidArgument),
    ],
)
def test_bad_publish_raises_and_changes_nothing(
    make_group: MakeGroup,
    make_index: MakeIndex,
    mutate: Callable[[list[str], dict[str, np.ndarray]], tuple[list[str], dict[str, np.ndarray]]],
    error: type[Exception],
) -> None:
    group = make_group(16)
    index = make_index(group)
    keys = keys_of("k", 3)
    pages = write_pages(group, 3, seed=1)
    bad_keys, bad_pages = mutate(keys, pages)
    with pytest.raises(error):
        index.publish(bad_keys, bad_pages)
    assert index.stats().entries == 0
    assert index.owned_pages()["kv"].size == 0
    assert group.available() == 13
    group.free(pages["kv"])


def test_publishing_a_page_the_index_owns_is_refused(make_group: MakeGroup, make_index: MakeIndex) -> None:
    group = make_group(16)
    index = make_index(group)
    pages = write_pages(group, 2, seed=1)
    index.publish(["a", "b"], pages)
    with pytest.raises(FailedPrecondition, match="already belongs"):
        index.publish(["c"], {"kv": pages["kv"][:1]})
    assert index.stats().entries == 2


def test_tenants_never_match(make_group: MakeGroup, make_index: MakeIndex) -> None:
    group = make_group(16)
    index = make_index(group)
    tokens = list(range(3 * PAGE_SIZE))
    keys_a = page_keys(tokens, PAGE_SIZE, cache_salt="tenant-a")
    keys_b = page_keys(tokens, PAGE_SIZE, cache_salt="tenant-b")
    index.publish(keys_a, write_pages(group, 3, seed=1), tenant="tenant-a")
    assert index.lookup(keys_a).l2_hit_pages == 3
    assert index.lookup(keys_b) == LookupResult(0, 0)
    assert len(index.pin(keys_b)) == 0
    index.publish(keys_b, write_pages(group, 3, seed=2), tenant="tenant-b")
    # Clearing one tenant leaves the other's pages alone.
    assert index.clear("tenant-a") == (3, 0)
    assert index.lookup(keys_a).l2_hit_pages == 0
    assert index.lookup(keys_b).l2_hit_pages == 3
    assert group.available() == 13


def test_eviction_is_lru_and_takes_the_deepest_page_of_a_prefix_first(
    make_group: MakeGroup, make_index: MakeIndex
) -> None:
    group = make_group(16)
    index = make_index(group)
    old, new = keys_of("old", 4), keys_of("new", 4)
    index.publish(old, write_pages(group, 4, seed=1))
    index.publish(new, write_pages(group, 4, seed=2))
    assert index.reclaim("kv", 2) == 2
    assert index.lookup(old).l2_hit_pages == 2  # the tail went, the head stays usable
    assert index.lookup(new).l2_hit_pages == 4
    # Touching the old prefix makes it more recent than the new one.
    index.unpin(index.pin(old))
    assert index.reclaim("kv", 1) == 1
    assert index.lookup(new).l2_hit_pages == 3
    assert index.lookup(old).l2_hit_pages == 2
    assert index.stats().evicted_pages == 3
    assert group.available() == 16 - 5


def test_pinned_pages_survive_eviction_and_clear(make_group: MakeGroup, make_index: MakeIndex) -> None:
    group = make_group(8)
    index = make_index(group)
    keys = keys_of("p", 6)
    index.publish(keys, write_pages(group, 6, seed=3))
    pin = index.pin(keys[:4])
    assert index.reclaim("kv", 8) == 2  # only the unpinned two
    assert index.reclaim("kv", 1) == 0
    assert index.clear() == (4, 0)
    assert index.lookup(keys).l2_hit_pages == 0
    # Cleared but still pinned: the holder's pages are intact and still allocated.
    for i in range(4):
        assert pin_bytes(group, dict(pin.pages), i)["kv"] == page_pattern(
            group.get_pool("kv").page_bytes, 3, i, "kv"
        )
    assert group.available() == 4
    index.unpin(pin)
    assert group.available() == 8
    with pytest.raises(FailedPrecondition, match="released twice"):
        index.unpin(pin)


def test_group_allocation_reclaims_through_the_index(make_group: MakeGroup, make_index: MakeIndex) -> None:
    group = make_group(8, sidecars=("swa",))
    index = make_index(group)
    index.publish(keys_of("f", 8), write_pages(group, 8, seed=4))
    assert group.available("kv") == 0
    # A worker's resolve needs 3 pages in both pools: the group calls the index's reclaim.
    transfers = [
        PoolTransfer("kv", device_indices=np.arange(3, dtype=np.int64)),
        PoolTransfer("swa", device_indices=np.arange(3, dtype=np.int64)),
    ]
    result = group.resolve_all(transfers)
    assert result.ok, result.reason
    assert index.stats().entries == 5
    assert index.lookup(keys_of("f", 8)).l2_hit_pages == 5
    assert group.release_transfers(result.transfers) == 6


def test_reclaim_of_an_unknown_pool_is_not_found(make_group: MakeGroup, make_index: MakeIndex) -> None:
    index = make_index(make_group(4))
    with pytest.raises(NotFound, match="nope"):
        index.reclaim("nope", 1)
    with pytest.raises(InvalidArgument):
        index.reclaim("kv", -1)


def test_close_frees_everything_once_even_with_pins(make_group: MakeGroup) -> None:
    group = make_group(8, derived=("draft",))
    index = ContentIndex(group, namespace="m", backend=None)
    keys = keys_of("c", 5)
    index.publish(keys, write_pages(group, 5, seed=5))
    pin = index.pin(keys)
    index.close()
    assert group.available() == 8
    index.unpin(pin)  # a no-op after close, never a double free
    index.close()
    assert group.available() == 8
    # No longer the group's reclaimer: another index may register, and a full pool evicts nothing.
    other = ContentIndex(group, namespace="n", backend=None)
    other.close()


def test_a_group_has_one_index(make_group: MakeGroup, make_index: MakeIndex) -> None:
    """The index registers itself as the group's one reclaimer: a second index on the same
    group is refused (it would evict pages it does not own) and leaves the first in charge."""
    group = make_group(4)
    index = make_index(group)
    with pytest.raises(AlreadyExists, match="already has a reclaimer"):
        ContentIndex(group, namespace="other", backend=None)
    index.publish(keys_of("o", 4), write_pages(group, 4, seed=7))
    got = group.alloc(1, reclaim=True)
    assert got is not None and index.stats().entries == 3  # the first index evicted for it
    group.free(got)


def test_lookup_without_backend_counts_l2_only(make_group: MakeGroup, make_index: MakeIndex) -> None:
    group = make_group(8)
    index = make_index(group)
    index.publish(["a", "b"], write_pages(group, 2, seed=6))
    assert index.lookup(["a", "b", "c"]) == LookupResult(2, 2)
    assert index.lookup(["b", "a"]) == LookupResult(2, 2)
    assert index.lookup(["c", "a"]) == LookupResult(0, 0)
    with pytest.raises(InvalidArgument):
        index.lookup("abc")


def test_a_pin_from_another_index_is_refused(make_group: MakeGroup, make_index: MakeIndex) -> None:
    group_a, group_b = make_group(4), make_group(4)
    index_a, index_b = make_index(group_a), make_index(group_b, namespace="model-b")
    index_a.publish(["k"], write_pages(group_a, 1, seed=1))
    index_b.publish(["k"], write_pages(group_b, 1, seed=2))
    pin_a, pin_b = index_a.pin(["k"]), index_b.pin(["k"])
    with pytest.raises(FailedPrecondition, match="not held by this index"):
        index_b.unpin(pin_a)
    assert index_b.stats().pinned_entries == 1
    index_a.unpin(pin_a)
    index_b.unpin(pin_b)


@pytest.mark.parametrize(
    ("bad", "quoted"),
    [("a/b", "'a/b'"), ("", "''"), (7, "7"), (None, "None"), (b"k", "b'k'")],
)
def test_check_keys_names_the_bad_key_among_many(bad: object, quoted: str) -> None:
    keys = [f"{i:064x}" for i in range(128)]
    assert check_keys(keys) == keys
    keys[77] = bad  # type: ignore[call-overload]
    with pytest.raises(InvalidArgument, match=f"got {re.escape(quoted)}$"):
        check_keys(keys)


def test_scoped_keys_refuse_the_tenant_separator_in_any_key() -> None:
    keys = [f"{i:064x}" for i in range(128)]
    assert scoped_keys("", keys) == keys
    assert scoped_keys("t", keys)[5].startswith(keys[5] + "~")
    keys[100] = "x~y"
    with pytest.raises(InvalidArgument, match="content key 'x~y' contains '~'"):
        scoped_keys("", keys)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"write_policy": "lazy"}, "unknown write policy 'lazy'; use one of ['write_through', "),
        ({"io_workers": 0}, "io_workers must be a positive int, got 0"),
        ({"max_queued_pages": 0}, "max_queued_pages must be a positive int, got 0"),
        ({"batch_pages": True}, "batch_pages must be a positive int, got True"),
        ({"max_finished_prefetches": 1.5}, "max_finished_prefetches must be a positive int, got 1.5"),
        ({"prefetch_timeout_base_s": -1.0}, "must be non-negative, got base_s=-1.0"),
        ({"prefetch_timeout_per_1k_tokens_s": -0.5}, "per_1k_tokens_s=-0.5"),
        ({"write_back_free_fraction": 0.5}, "write_back_free_fraction must be in [0, 0.5), got 0.5"),
        ({"write_back_free_fraction": -0.1}, "write_back_free_fraction must be in [0, 0.5), got -0.1"),
    ],
)
def test_index_options_refuse_what_cannot_work(options: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        IndexOptions(**options)  # type: ignore[arg-type]


def test_index_options_take_a_write_policy_by_name() -> None:
    assert IndexOptions(write_policy="write_back").write_policy is WritePolicy.WRITE_BACK
    assert IndexOptions().write_policy is WritePolicy.WRITE_THROUGH
