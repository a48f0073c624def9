"""HostPoolGroup: anchor + sidecars, atomic resolve with rollback, release exactly once."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from hicached.errors import AlreadyExists, DoubleFree, InvalidArgument, NotFound, OutOfRange
from hicached.l2 import (
    HostKVPool,
    HostLayout,
    HostPoolGroup,
    LayerRoute,
    PoolEntry,
    PoolTransfer,
    layer_map,
    layer_range,
)

from .conftest import PoolReclaimer, mha_spec, mla_spec

MakePool = Callable[..., HostKVPool]


def _snapshot(group: HostPoolGroup) -> dict[str, list[int]]:
    return {e.name: e.host_pool.allocator.allocated_pages().tolist() for e in group.entries}


def _full(group: HostPoolGroup) -> bool:
    return all(e.host_pool.allocator.available() == e.host_pool.num_pages for e in group.entries)


@pytest.fixture
def group(make_pool: MakePool) -> HostPoolGroup:
    """kv (anchor, 16 pages), swa (8), mamba (16), draft (derived from kv), index (derived from swa)."""
    return HostPoolGroup(
        [
            PoolEntry("swa", make_pool(num_pages=8)),
            PoolEntry("kv", make_pool(mla_spec(), num_pages=16), is_primary_index_anchor=True),
            PoolEntry("mamba", make_pool(num_pages=16)),
            PoolEntry("draft", make_pool(num_pages=16), indices_from_pool="kv"),
            PoolEntry("index", make_pool(num_pages=8), indices_from_pool="swa"),
        ]
    )


def _pages(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


# ---- membership ------------------------------------------------------------


def test_anchor_and_name_sorted_entries(group: HostPoolGroup) -> None:
    assert group.anchor.name == "kv"
    assert [e.name for e in group.entries] == ["draft", "index", "kv", "mamba", "swa"]
    assert group.get_pool("swa").num_pages == 8


def test_first_entry_is_the_anchor_when_none_is_marked(make_pool: MakePool) -> None:
    g = HostPoolGroup([PoolEntry("a", make_pool()), PoolEntry("b", make_pool())])
    assert g.anchor.name == "a"
    empty = HostPoolGroup()
    with pytest.raises(NotFound, match="empty"):
        _ = empty.anchor
    empty.add_entry(PoolEntry("x", make_pool()))
    assert empty.anchor.name == "x"


def test_unknown_pool_is_not_found_and_lists_known(group: HostPoolGroup) -> None:
    with pytest.raises(NotFound, match=r"'ssm' is not in this group \(known: \['draft', 'index', 'kv'"):
        group.get_entry("ssm")


def test_duplicate_name_and_second_anchor_are_refused(group: HostPoolGroup, make_pool: MakePool) -> None:
    before = [e.name for e in group.entries]
    with pytest.raises(AlreadyExists, match="'swa' is already registered"):
        group.add_entry(PoolEntry("swa", make_pool()))
    with pytest.raises(AlreadyExists, match="'kv2' cannot be the anchor: 'kv' already is"):
        group.add_entry(PoolEntry("kv2", make_pool(), is_primary_index_anchor=True))
    with pytest.raises(AlreadyExists, match="already registered as 'kv'"):
        group.add_entry(PoolEntry("again", group.get_pool("kv")))
    assert [e.name for e in group.entries] == before


def test_constructor_validates_the_whole_list(make_pool: MakePool) -> None:
    with pytest.raises(AlreadyExists, match="'a' is listed twice"):
        HostPoolGroup([PoolEntry("a", make_pool()), PoolEntry("a", make_pool())])
    with pytest.raises(AlreadyExists, match=r"\['a', 'b'\] are all marked"):
        HostPoolGroup(
            [
                PoolEntry("a", make_pool(), is_primary_index_anchor=True),
                PoolEntry("b", make_pool(), is_primary_index_anchor=True),
            ]
        )


@pytest.mark.parametrize(
    ("entry_kwargs", "error", "message"),
    [
        ({"name": "d", "indices_from_pool": "nope"}, InvalidArgument, "unknown pool 'nope'"),
        ({"name": "d", "indices_from_pool": "draft"}, InvalidArgument, "'draft', which is itself derived"),
        ({"name": "", "indices_from_pool": None}, InvalidArgument, "non-empty"),
        ({"name": "d", "packed_draft_layers": 3}, InvalidArgument, "packed_draft_layers=3"),
        ({"name": "d", "packed_draft_layers": -1}, InvalidArgument, "packed_draft_layers=-1"),
    ],
)
def test_bad_entries_are_refused_and_change_nothing(
    group: HostPoolGroup,
    make_pool: MakePool,
    entry_kwargs: dict[str, object],
    error: type[Exception],
    message: str,
) -> None:
    before = [e.name for e in group.entries]
    with pytest.raises(error, match=message):
        group.add_entry(PoolEntry(host_pool=make_pool(num_pages=16), **entry_kwargs))  # type: ignore[arg-type]
    assert [e.name for e in group.entries] == before


def test_derived_pool_must_hold_the_source_indices(group: HostPoolGroup, make_pool: MakePool) -> None:
    with pytest.raises(
        InvalidArgument, match=r"'small' \(4 pages of 4 tokens\) cannot hold the indices of 'kv'"
    ):
        group.add_entry(PoolEntry("small", make_pool(num_pages=4), indices_from_pool="kv"))
    with pytest.raises(InvalidArgument, match="anchor cannot derive"):
        HostPoolGroup([PoolEntry("a", make_pool(), indices_from_pool="b")])


# ---- the two reference scenarios --------------------------------------------


def test_multi_pool_resolve_and_release_return_every_pool_to_full(group: HostPoolGroup) -> None:
    result = group.resolve_all(
        [
            PoolTransfer("kv", _pages(5)),
            PoolTransfer("swa", _pages(3, 100)),
            PoolTransfer("mamba", _pages(1, 7)),
            PoolTransfer("draft"),
            PoolTransfer("index"),
        ]
    )
    assert result.ok, result.reason
    by = {t.name: t for t in result.transfers}
    assert [t.name for t in result.transfers] == ["kv", "swa", "mamba", "draft", "index"]
    assert by["kv"].host_indices.tolist() == [0, 1, 2, 3, 4]  # type: ignore[union-attr]
    assert by["draft"].host_indices.tolist() == by["kv"].host_indices.tolist()  # type: ignore[union-attr]
    assert by["draft"].device_indices.tolist() == _pages(5).tolist()  # type: ignore[union-attr]
    assert by["index"].host_indices.tolist() == by["swa"].host_indices.tolist()  # type: ignore[union-attr]
    assert by["index"].device_indices.tolist() == _pages(3, 100).tolist()  # type: ignore[union-attr]
    assert [by[n].host_allocated for n in ("kv", "swa", "mamba", "draft", "index")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert group.available("kv") == 11 and group.available("swa") == 5 and group.available("mamba") == 15
    assert group.available("draft") == 16  # derived pools allocate nothing
    assert group.release_transfers(result.transfers) == 5 + 3 + 1
    assert _full(group)


def test_partial_failure_leaves_every_pool_exactly_as_before(group: HostPoolGroup) -> None:
    held = group.alloc(2, pool="mamba")
    assert held is not None and group.alloc(3) is not None
    before = _snapshot(group)
    transfers = [
        PoolTransfer("kv", _pages(4)),
        PoolTransfer("mamba", _pages(2)),  # fits
        PoolTransfer("swa", _pages(9)),  # 8-page pool: fails after kv and mamba allocated
        PoolTransfer("draft"),
    ]
    result = group.resolve_all(transfers)
    assert not result.ok
    assert "pool 'swa': no room for 9 pages (8 free" in result.reason
    assert _snapshot(group) == before
    assert [t.host_indices for t in result.transfers] == [None, None, None, None]
    assert [t.host_allocated for t in result.transfers] == [False] * 4
    assert all(t.host_indices is None for t in transfers)  # input untouched


# ---- resolve_host_transfers: the reference algorithm -------------------------


def test_skip_rules(group: HostPoolGroup) -> None:
    preset = np.array([9, 10], dtype=np.int64)
    result = group.resolve_host_transfers(
        [
            PoolTransfer("swa", _pages(2), host_indices=preset),  # already resolved: skipped
            PoolTransfer("mamba"),  # no device indices: skipped
            PoolTransfer("unknown", _pages(3)),  # unknown pool: skipped (reference)
        ]
    )
    assert result.ok
    swa, mamba, unknown = result.transfers
    assert swa.host_indices.tolist() == [9, 10] and not swa.host_allocated  # type: ignore[union-attr]
    assert swa.host_indices is not preset
    assert mamba.host_indices is None and unknown.host_indices is None
    assert _full(group)
    assert group.release_transfers(result.transfers) == 0


def test_resolve_all_rejects_unknown_pools_before_allocating(group: HostPoolGroup) -> None:
    with pytest.raises(NotFound, match="'unknown'"):
        group.resolve_all([PoolTransfer("kv", _pages(2)), PoolTransfer("unknown", _pages(3))])
    assert _full(group)


def test_transfers_are_processed_in_name_order(make_pool: MakePool) -> None:
    calls: list[str] = []
    g = HostPoolGroup([PoolEntry(name, make_pool(num_pages=4)) for name in ("zeta", "alpha", "mid")])

    def reclaimer(name: str) -> Callable[[int], int]:
        def reclaim(n: int) -> int:
            calls.append(name)
            return g.free(_pages(n), pool=name)

        return reclaim

    for entry in g.entries:
        assert g.alloc(4, pool=entry.name) is not None  # every pool full: each one reclaims
    g.register_reclaimer(PoolReclaimer({e.name: reclaimer(e.name) for e in g.entries}))
    result = g.resolve_host_transfers([PoolTransfer(n, _pages(2)) for n in ("zeta", "mid", "alpha")])
    assert result.ok
    assert calls == ["alpha", "mid", "zeta"]
    assert [t.name for t in result.transfers] == ["zeta", "mid", "alpha"]  # input order kept


def test_reclaim_once_then_retry(group: HostPoolGroup) -> None:
    calls: list[int] = []
    taken = group.alloc(8, pool="swa")
    assert taken is not None

    def reclaim(n: int) -> int:
        calls.append(n)
        return group.free(taken[:1], pool="swa")  # frees too little

    reclaimer = PoolReclaimer({"swa": reclaim})
    group.register_reclaimer(reclaimer)
    result = group.resolve_host_transfers([PoolTransfer("swa", _pages(3))])
    assert not result.ok and calls == [3]  # called once, then one retry, then give up
    assert group.available("swa") == 1

    def reclaim_enough(n: int) -> int:
        calls.append(n)
        return group.free(taken[1 : 1 + n], pool="swa")

    reclaimer.reclaims["swa"] = reclaim_enough
    result = group.resolve_host_transfers([PoolTransfer("swa", _pages(3))])
    assert result.ok and calls == [3, 2]  # asked for the shortfall only (one page was free)
    got = result.transfers[0].host_indices
    assert got is not None and set(got.tolist()) == {0, 1, 2} and group.available("swa") == 0


def test_reclaim_that_raises_rolls_back(group: HostPoolGroup) -> None:
    def broken(n: int) -> int:
        raise RuntimeError(f"evictor failed for {n}")

    assert group.alloc(8, pool="swa") is not None
    before = _snapshot(group)
    group.register_reclaimer(PoolReclaimer({"swa": broken}))
    with pytest.raises(RuntimeError, match="evictor failed for 2"):
        group.resolve_all(
            [PoolTransfer("kv", _pages(3)), PoolTransfer("mamba", _pages(1)), PoolTransfer("swa", _pages(2))]
        )
    assert _snapshot(group) == before


def test_derived_binds_to_primary_indices(group: HostPoolGroup) -> None:
    primary_dev, primary_host = _pages(3, 50), _pages(3, 7)
    result = group.resolve_host_transfers([PoolTransfer("draft")], primary_dev, primary_host)
    assert result.ok
    (draft,) = result.transfers
    assert draft.host_indices.tolist() == [7, 8, 9] and draft.device_indices.tolist() == [50, 51, 52]  # type: ignore[union-attr]
    assert draft.host_indices is not primary_host and not draft.host_allocated
    assert _full(group)


def test_per_transfer_indices_from_pool_is_honoured(group: HostPoolGroup) -> None:
    result = group.resolve_host_transfers(
        [PoolTransfer("mamba", indices_from_pool="swa"), PoolTransfer("swa", _pages(2))]
    )
    assert result.ok
    mamba, swa = result.transfers
    assert mamba.host_indices.tolist() == swa.host_indices.tolist()  # type: ignore[union-attr]
    assert group.available("mamba") == 16
    assert group.release_transfers(result.transfers) == 2
    assert _full(group)


def test_missing_source_fails_and_rolls_back(group: HostPoolGroup) -> None:
    result = group.resolve_host_transfers([PoolTransfer("mamba", _pages(2)), PoolTransfer("index")])
    assert not result.ok
    assert "derived pool 'index' needs a transfer of 'swa'" in result.reason
    assert _full(group)


def test_duplicate_transfer_names_and_bad_indices_raise(group: HostPoolGroup) -> None:
    with pytest.raises(InvalidArgument, match="'swa' appears in more than one transfer"):
        group.resolve_all([PoolTransfer("swa", _pages(1)), PoolTransfer("swa", _pages(1))])
    with pytest.raises(InvalidArgument, match=r"swa\.device_indices must be integers"):
        group.resolve_all([PoolTransfer("kv", _pages(1)), PoolTransfer("swa", np.array([0.5]))])  # type: ignore[arg-type]
    assert _full(group)


def test_inputs_are_never_mutated_and_outputs_are_fresh(group: HostPoolGroup) -> None:
    dev = _pages(2)
    transfers = [PoolTransfer("kv", dev), PoolTransfer("swa", dev), PoolTransfer("draft")]
    result = group.resolve_all(transfers)
    assert result.ok
    assert [t.host_indices for t in transfers] == [None, None, None]
    assert dev.tolist() == [0, 1]
    kv, swa, draft = result.transfers
    assert kv.device_indices is not dev and draft.host_indices is not kv.host_indices
    draft.host_indices[:] = 99  # type: ignore[index]
    assert kv.host_indices.tolist() == [0, 1]  # type: ignore[union-attr]
    group.release_transfers([kv, swa])
    assert _full(group)


# ---- release exactly once ---------------------------------------------------


def test_release_twice_is_a_double_free_that_changes_nothing(group: HostPoolGroup) -> None:
    first = group.resolve_all([PoolTransfer("kv", _pages(2)), PoolTransfer("swa", _pages(2))])
    second = group.resolve_all([PoolTransfer("kv", _pages(3))])
    assert first.ok and second.ok
    assert group.release_transfers(first.transfers) == 4
    before = _snapshot(group)
    with pytest.raises(DoubleFree, match="not allocated"):
        group.release_transfers(second.transfers + first.transfers)  # second is valid, but all-or-nothing
    assert _snapshot(group) == before
    assert group.release_transfers(second.transfers) == 3
    assert _full(group)


def test_release_skips_derived_and_caller_owned(group: HostPoolGroup) -> None:
    owned = group.alloc(2, pool="swa")
    result = group.resolve_all(
        [
            PoolTransfer("kv", _pages(2)),
            PoolTransfer("swa", _pages(2), host_indices=owned),
            PoolTransfer("draft"),
        ]
    )
    assert result.ok
    assert group.release_transfers(result.transfers) == 2  # kv only: swa is the caller's, draft is kv's
    assert group.available("swa") == 6
    assert group.free(owned, pool="swa") == 2  # type: ignore[arg-type]
    assert _full(group)


def test_release_of_unknown_pool_changes_nothing(group: HostPoolGroup) -> None:
    result = group.resolve_all([PoolTransfer("kv", _pages(2))])
    before = _snapshot(group)
    bogus = PoolTransfer("gone", host_indices=_pages(1), host_allocated=True)
    with pytest.raises(NotFound, match="'gone'"):
        group.release_transfers([*result.transfers, bogus])
    assert _snapshot(group) == before


def test_release_of_out_of_range_page_changes_nothing(group: HostPoolGroup) -> None:
    result = group.resolve_all([PoolTransfer("kv", _pages(2))])
    before = _snapshot(group)
    bogus = PoolTransfer("swa", host_indices=np.array([3, 8]), host_allocated=True)
    with pytest.raises(OutOfRange, match="page 8 is out of range"):
        group.release_transfers([*result.transfers, bogus])
    assert _snapshot(group) == before


def test_anchor_without_room_fails_cleanly(group: HostPoolGroup) -> None:
    result = group.resolve_all([PoolTransfer("kv", _pages(17)), PoolTransfer("swa", _pages(1))])
    assert not result.ok and "pool 'kv': no room for 17 pages" in result.reason
    assert _full(group)


def test_group_alloc_free_available_default_to_the_anchor(group: HostPoolGroup) -> None:
    pages = group.alloc(4)
    assert pages is not None and group.available() == 12
    assert group.free(pages) == 4
    assert group.alloc(17) is None
    calls: list[int] = []

    def record(n: int) -> int:
        calls.append(n)
        return 0

    group.register_reclaimer(PoolReclaimer({"kv": record}))
    # 17 pages can never fit in 16: the reclaimer's reclaim is not even called (nothing is evicted).
    assert group.alloc(17, reclaim=True) is None and calls == []


def test_one_reclaimer_at_a_time(group: HostPoolGroup) -> None:
    """The group's evictor is registered explicitly, one at a time; an allocation without
    ``reclaim`` (and any after unregistering) never calls it."""
    calls: list[int] = []

    def free_held(n: int) -> int:
        calls.append(n)
        return group.free(held[:n])

    first, second = PoolReclaimer({"kv": free_held}), PoolReclaimer({"kv": free_held})
    group.register_reclaimer(first)
    group.register_reclaimer(first)  # the same one again changes nothing
    with pytest.raises(AlreadyExists, match="already has a reclaimer"):
        group.register_reclaimer(second)
    held = group.alloc(16)
    assert held is not None
    assert group.alloc(2) is None and calls == []  # reclaim=False: nobody is asked
    got = group.alloc(2, reclaim=True)
    assert got is not None and calls == [2]
    group.unregister_reclaimer(second)  # not the registered one: a no-op
    group.unregister_reclaimer(first)
    assert group.alloc(1, reclaim=True) is None and calls == [2]
    group.register_reclaimer(second)


def test_concurrent_resolves_and_releases_end_at_full_capacity(group: HostPoolGroup) -> None:
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            start.wait()
            for _ in range(100):
                n = int(rng.integers(1, 4))
                result = group.resolve_all(
                    [PoolTransfer("kv", _pages(n)), PoolTransfer("swa", _pages(n)), PoolTransfer("draft")]
                )
                if result.ok:
                    group.release_transfers(result.transfers)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _full(group)


# ---- layers -------------------------------------------------------------------


def test_layer_mappers_and_packed_draft_layers(make_pool: MakePool) -> None:
    kv = make_pool(mha_spec(layers=4))  # 3 target layers + 1 packed draft layer
    swa = make_pool(mha_spec(layers=2))
    stage = make_pool(mla_spec(layers=2))
    g = HostPoolGroup(
        [
            PoolEntry("kv", kv, packed_draft_layers=1, is_primary_index_anchor=True),
            PoolEntry("swa", swa, layer_mapper=layer_map({0: 0, 2: 1})),
            PoolEntry("stage", stage, layer_mapper=layer_range(1, 3)),
        ]
    )
    assert g.get_entry("kv").target_layers == 3
    assert g.layer_routes(0) == [LayerRoute("kv", 0), LayerRoute("swa", 0)]
    assert g.layer_routes(2) == [LayerRoute("kv", 2), LayerRoute("stage", 1), LayerRoute("swa", 1)]
    assert g.draft_routes(0) == [LayerRoute("kv", 3, is_draft=True)]
    assert g.draft_routes(1) == []
    with pytest.raises(OutOfRange, match="sent global layer 3 to layer 3"):
        g.layer_routes(3)  # identity mapper of kv points into the draft layer
    with pytest.raises(OutOfRange, match="draft layer 1 is out of range"):
        g.get_entry("kv").draft_pool_layer(1)
    with pytest.raises(InvalidArgument, match=r"\[5, 2\)"):
        layer_range(5, 2)


def test_a_new_pool_type_is_just_another_entry(make_pool: MakePool) -> None:
    g = HostPoolGroup([PoolEntry("kv", make_pool(mla_spec(), layout=HostLayout.PAGE_FIRST_DIRECT))])
    g.add_entry(PoolEntry("indexer", make_pool(mha_spec(layers=1), layout=HostLayout.LAYER_FIRST)))
    result = g.resolve_all([PoolTransfer("kv", _pages(2)), PoolTransfer("indexer", _pages(2))])
    assert result.ok and g.release_transfers(result.transfers) == 4


def test_close_closes_every_pool(group: HostPoolGroup) -> None:
    group.close()
    assert all(e.host_pool.segment.closed for e in group.entries)
