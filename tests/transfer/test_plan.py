"""Copy planning: validation before any copy, layer ordering, accounting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch
from hicached_client.export import ShmKVPool

from hicached.errors import InvalidArgument, OutOfRange
from hicached.l2.host_pool import HostKVPool
from hicached.l2.layout import HostLayout, PoolKind
from hicached.transfer import DeviceMappings, DevicePoolView, Direction, Medium, build_plan
from hicached.transfer.plan import LayerCache, _check_range, _check_unique

from .conftest import DIM, HEADS, PAGE, open_view, pages, spec_of

Make = Callable[..., object]


@pytest.fixture
def pool(
    make_device: Callable[..., ShmKVPool], make_host: Callable[..., HostKVPool], mappings: DeviceMappings
) -> tuple[DevicePoolView, HostKVPool]:
    spec = spec_of()
    return open_view(make_device(spec, pages=12), mappings), make_host(spec, pages=16)


def test_plan_orders_steps_by_global_layer_with_tail_last(
    make_device: Callable[..., ShmKVPool], make_host: Callable[..., HostKVPool], mappings: DeviceMappings
) -> None:
    spec = spec_of(layers=3)
    main = open_view(make_device(spec), mappings, "main", layer_ids=[2, 0, 1])
    draft = open_view(make_device(spec), mappings, "draft", layer_ids=[-1, 1, -1])
    items = [
        (main, make_host(spec), pages(0, 1), pages(2, 3)),
        (draft, make_host(spec), pages(5), pages(9)),
    ]
    plan = build_plan(Direction.H2D, items)
    assert [s.layer for s in plan.steps] == [0, 1, 2, -1]
    assert [len(s.copies) for s in plan.steps] == [2, 4, 2, 4]  # K and V of each pool layer
    page_bytes = PAGE * HEADS * DIM * 2
    assert plan.tokens_by_pool == {"main": 2 * PAGE, "draft": PAGE}
    assert plan.bytes_by_pool == {"main": 2 * 3 * 2 * page_bytes, "draft": 3 * 2 * page_bytes}
    assert plan.nbytes == 9 * 2 * page_bytes
    step1 = plan.steps[1]
    # H2D: source is the host pool, destination the device buffers.
    assert all(c.dst.shape[1:] == (PAGE, HEADS, DIM) for c in step1.copies)
    assert np.array_equal(step1.copies[0].src_pages, [2, 3])
    assert np.array_equal(step1.copies[0].dst_pages, [0, 1])


def test_d2h_sources_are_device_pages(pool: tuple[DevicePoolView, HostKVPool]) -> None:
    view, host = pool
    plan = build_plan(Direction.D2H, [(view, host, pages(3, 4), pages(0, 9))])
    copy = plan.steps[0].copies[0]
    assert copy.src.data_ptr() == view.k[0].data_ptr()
    assert copy.dst.data_ptr() == host.kv_layer_pages(0, 0).data_ptr()
    assert np.array_equal(copy.src_pages, [3, 4]) and np.array_equal(copy.dst_pages, [0, 9])


def test_plan_copies_page_indices(pool: tuple[DevicePoolView, HostKVPool]) -> None:
    view, host = pool
    dev = pages(1, 2)
    plan = build_plan(Direction.D2H, [(view, host, dev, pages(3, 4))])
    dev[0] = 11
    assert plan.steps[0].copies[0].src_pages[0] == 1


def test_empty_transfer_is_an_empty_plan(pool: tuple[DevicePoolView, HostKVPool]) -> None:
    view, host = pool
    plan = build_plan(Direction.H2D, [(view, host, pages(), pages())])
    assert plan.steps == () and plan.nbytes == 0 and plan.tokens_by_pool == {"kv": 0}


BAD_PAGES = [
    ("length mismatch", (pages(1, 2), pages(1)), InvalidArgument, "2 device pages but 1 host pages"),
    ("device too big", (pages(1, 12), pages(1, 2)), OutOfRange, "device page 12 at position 1"),
    ("device negative", (pages(-1), pages(1)), OutOfRange, "device page -1 at position 0"),
    ("host too big", (pages(1, 2), pages(0, 17)), OutOfRange, "host page 17 at position 1"),
    ("host negative", (pages(1), pages(-3)), OutOfRange, "host page -3"),
    ("2-D pages", (np.zeros((2, 2), np.int64), pages(1, 2)), InvalidArgument, "must be 1-D"),
    ("float pages", (np.array([1.0]), pages(1)), InvalidArgument, "must be integers"),
]


@pytest.mark.parametrize(("case", "pair", "exc", "needle"), BAD_PAGES, ids=[c[0] for c in BAD_PAGES])
def test_bad_pages_are_rejected_naming_the_pool(
    pool: tuple[DevicePoolView, HostKVPool],
    case: str,
    pair: tuple[np.ndarray, np.ndarray],
    exc: type[Exception],
    needle: str,
) -> None:
    view, host = pool
    dev, host_pages = pair
    for direction in Direction:
        with pytest.raises(exc) as info:
            build_plan(direction, [(view, host, dev, host_pages)])
        assert "pool 'kv'" in str(info.value) and needle in str(info.value), (case, str(info.value))


def test_duplicate_destination_pages_are_rejected(pool: tuple[DevicePoolView, HostKVPool]) -> None:
    view, host = pool
    # D2H writes host pages: duplicates there are fatal, duplicate device (source) pages are not.
    with pytest.raises(InvalidArgument, match="destination host page 4 appears twice"):
        build_plan(Direction.D2H, [(view, host, pages(1, 2, 3), pages(4, 5, 4))])
    build_plan(Direction.D2H, [(view, host, pages(1, 1), pages(4, 5))])
    with pytest.raises(
        InvalidArgument, match=r"destination device page 1 appears twice \(positions 0 and 1\)"
    ):
        build_plan(Direction.H2D, [(view, host, pages(1, 1), pages(4, 5))])
    build_plan(Direction.H2D, [(view, host, pages(1, 2), pages(4, 4))])


def test_pool_named_twice_is_rejected(pool: tuple[DevicePoolView, HostKVPool]) -> None:
    view, host = pool
    with pytest.raises(InvalidArgument, match="pool 'kv' appears twice"):
        build_plan(Direction.D2H, [(view, host, pages(1), pages(1)), (view, host, pages(2), pages(2))])


def _bf16(
    tokens: int, heads: int = HEADS, dim: int = DIM, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return torch.zeros(tokens, heads, dim, dtype=dtype)


SPEC_MISMATCH: list[tuple[str, Callable[[DevicePoolView], DevicePoolView], str]] = [
    ("page size", lambda v: replace(v, page_size=8), "device page size 8 != host 4"),
    ("too few K", lambda v: replace(v, k=v.k[:1]), "1 device K buffers != 2 layers"),
    ("too few V", lambda v: replace(v, v=v.v[:1]), "1 device V buffers, expected 2"),
    ("layer ids", lambda v: replace(v, layer_ids=[0]), "1 layer ids != 2 layers"),
    ("bad layer id", lambda v: replace(v, layer_ids=[0, -2]), "invalid global layer id -2"),
    ("dtype", lambda v: replace(v, k=[_bf16(48, dtype=torch.float16), v.k[1]]), "device dtype torch.float16"),
    ("heads", lambda v: replace(v, k=[_bf16(48, heads=3), v.k[1]]), "device page shape (4, 3, 8)"),
    ("ragged tokens", lambda v: replace(v, k=[v.k[0], _bf16(44)]), "device shape (44, 2, 8)"),
    ("partial page", lambda v: replace(v, k=[_bf16(46), _bf16(46)]), "46 device tokens"),
    ("medium", lambda v: replace(v, medium=Medium.CUDA), "pool declares cuda"),
]


@pytest.mark.parametrize(("case", "mutate", "needle"), SPEC_MISMATCH, ids=[c[0] for c in SPEC_MISMATCH])
def test_device_pool_must_match_host_spec(
    pool: tuple[DevicePoolView, HostKVPool],
    case: str,
    mutate: Callable[[DevicePoolView], DevicePoolView],
    needle: str,
) -> None:
    view, host = pool
    with pytest.raises(InvalidArgument) as info:
        build_plan(Direction.D2H, [(mutate(view), host, pages(1), pages(1))])
    assert needle in str(info.value), (case, str(info.value))


def test_mla_pool_has_no_v_buffers(
    make_device: Callable[..., ShmKVPool], make_host: Callable[..., HostKVPool], mappings: DeviceMappings
) -> None:
    spec = spec_of(PoolKind.MLA)
    view = open_view(make_device(spec), mappings)
    host = make_host(spec, HostLayout.PAGE_FIRST)
    assert view.v == []
    plan = build_plan(Direction.D2H, [(view, host, pages(0, 1), pages(2, 3))])
    assert [len(s.copies) for s in plan.steps] == [1, 1]
    with pytest.raises(InvalidArgument, match="1 device V buffers, expected 0"):
        build_plan(Direction.D2H, [(replace(view, v=[view.k[0]]), host, pages(0), pages(0))])


def test_the_layer_cache_serves_only_the_view_and_pool_it_checked(
    pool: tuple[DevicePoolView, HostKVPool],
) -> None:
    """A cached check is reused for the same (view, host pool) objects and never for another
    view of the same name: a mismatching one is still refused."""
    view, host = pool
    cache: LayerCache = {}
    first = build_plan(Direction.D2H, [(view, host, pages(1), pages(2))], cache=cache)
    assert list(cache) == ["kv"]
    again = build_plan(Direction.D2H, [(view, host, pages(3), pages(4))], cache=cache)
    assert again.steps[0].copies[0].src is first.steps[0].copies[0].src  # the cached page views
    assert again.steps[0].copies[0].rows is first.steps[0].copies[0].rows  # and their word rows
    assert first.steps[0].copies[0].rows is not None
    bad = replace(view, page_size=view.page_size * 2)
    with pytest.raises(InvalidArgument, match="device page size"):
        build_plan(Direction.D2H, [(bad, host, pages(1), pages(2))], cache=cache)


@pytest.mark.parametrize("n", [65, 1000])
def test_range_and_repeat_checks_of_a_large_batch_in_order_or_not(n: int) -> None:
    """Above SMALL_BATCH an ascending batch is bounded by its ends and has no repeat; any
    other is checked in full, naming the first bad position either way."""
    good = np.arange(3, 3 + n, dtype=np.int64)
    assert _check_range("kv", "host", good, 3 + n) is True  # in order: build_plan skips the repeat check
    assert _check_range("kv", "host", good[::-1].copy(), 3 + n) is False
    _check_unique("kv", "host", good[::-1].copy())
    with pytest.raises(OutOfRange, match=r"host page -1 at position 0 is out of range"):
        _check_range("kv", "host", np.concatenate(([-1], good)), 3 + n)
    with pytest.raises(OutOfRange, match=rf"host page {3 + n} at position {n} is out of range"):
        _check_range("kv", "host", np.concatenate((good, [3 + n])), 3 + n)
    repeated = good.copy()
    repeated[7] = repeated[6]  # in order, but not strictly: a repeat
    assert _check_range("kv", "host", repeated, 3 + n) is False
    with pytest.raises(InvalidArgument, match=f"host page {repeated[6]} appears twice"):
        _check_unique("kv", "host", repeated)
