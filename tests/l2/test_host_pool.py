"""Host pools: layouts, flat page round trips, padding page, warm re-open, pinning."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from hicached.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OutOfRange
from hicached.l2 import (
    POOL_CLASSES,
    HostKVPool,
    HostLayout,
    KVSpec,
    MHAHostPool,
    MLAHostPool,
    PoolKind,
    SharedSegment,
    create_host_pool,
    open_host_pool,
    pin_host_memory,
)
from hicached.l2.host_pool import HEADER_BYTES
from hicached.l2.layout import LAYOUTS

from .conftest import mha_spec, mla_spec

MakePool = Callable[..., HostKVPool]
SPECS = {"mha": mha_spec(), "mla": mla_spec()}


def _fill_random(pool: HostKVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = pool.buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _reference_flat_page(pool: HostKVPool, page: int) -> torch.Tensor:
    """The reference's get_data_page(flat=True), written out per layout."""
    ps, buf = pool.page_size, pool.buffer
    if pool.layout is HostLayout.LAYER_FIRST:
        data = buf[:, :, page * ps : (page + 1) * ps]
    elif pool.layout is HostLayout.PAGE_FIRST:
        data = buf[:, page * ps : (page + 1) * ps]
    else:
        data = buf[:, page : page + 1]
    return data.flatten().view(torch.uint8)


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("layout", list(HostLayout))
def test_set_page_q_from_page_p_round_trips_bytes(make_pool: MakePool, kind: str, layout: HostLayout) -> None:
    pool = make_pool(SPECS[kind], layout, num_pages=6)
    _fill_random(pool, seed=7)
    p, q = 1, 4
    untouched = [pool.get_page_flat(i) for i in range(pool.total_pages)]
    flat = pool.get_page_flat(p)
    assert flat.dtype == torch.uint8 and flat.numel() == pool.page_bytes
    assert not torch.equal(flat, pool.get_page_flat(q))
    pool.set_page_flat(q, flat)
    assert bytes(pool.get_page_flat(q).numpy()) == bytes(flat.numpy())
    for i in range(pool.total_pages):
        if i != q:
            assert torch.equal(pool.get_page_flat(i), untouched[i]), f"page {i} changed"


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("layout", list(HostLayout))
def test_flat_order_is_the_references(make_pool: MakePool, kind: str, layout: HostLayout) -> None:
    pool = make_pool(SPECS[kind], layout, num_pages=5)
    _fill_random(pool, seed=3)
    for page in (0, 2, pool.num_pages):
        assert torch.equal(pool.get_page_flat(page), _reference_flat_page(pool, page))
        joined = b"".join(bytes(c) for c in pool.page_chunks(page))
        assert joined == bytes(pool.get_page_flat(page).numpy())


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("layout", list(HostLayout))
def test_kv_layer_pages_is_a_view_of_the_right_slots(
    make_pool: MakePool, kind: str, layout: HostLayout
) -> None:
    spec = SPECS[kind]
    pool = make_pool(spec, layout, num_pages=5)
    for kv in range(spec.num_kv):
        for layer in range(spec.num_layers):
            view = pool.kv_layer_pages(kv, layer)
            assert tuple(view.shape) == (pool.total_pages, spec.page_size, spec.num_heads, spec.head_dim)
            view[3] = float(1 + kv * spec.num_layers + layer)
    # Every (kv, layer) wrote its own part of page 3 and nothing else.
    for page in range(pool.total_pages):
        flat = pool.get_page_flat(page)
        assert bool(flat.any()) == (page == 3)
    for kv in range(spec.num_kv):
        for layer in range(spec.num_layers):
            expect = float(1 + kv * spec.num_layers + layer)
            assert bool((pool.kv_layer_pages(kv, layer)[3] == expect).all())


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("num_pages", [1, 5])
def test_page_extents_are_the_layouts_for_every_page(
    make_pool: MakePool, kind: str, layout: HostLayout, num_pages: int
) -> None:
    """The pool shifts page 0's extents by a fixed step instead of asking the layout per page
    (an L3 batch asks for 128 pages' chunks at a time): the same runs, page by page."""
    pool = make_pool(SPECS[kind], layout, num_pages=num_pages)
    for page in range(pool.total_pages):
        assert pool.page_extents(page) == LAYOUTS[layout].page_extents(pool.spec, pool.total_pages, page)


def test_page_chunks_are_zero_copy(make_pool: MakePool) -> None:
    pool = make_pool(mha_spec(), HostLayout.LAYER_FIRST, num_pages=4)
    chunks = pool.page_chunks(2)
    assert len(chunks) == 2 * pool.spec.num_layers
    chunks[0][0] = 0xAB
    assert int(pool.get_page_flat(2)[0]) == 0xAB
    assert len(make_pool(mha_spec(), HostLayout.PAGE_FIRST, num_pages=4).page_chunks(1)) == 2
    assert len(make_pool(mla_spec(), HostLayout.PAGE_FIRST_DIRECT, num_pages=4).page_chunks(1)) == 1


def test_get_page_flat_into_a_caller_buffer(make_pool: MakePool) -> None:
    pool = make_pool(mha_spec(), HostLayout.LAYER_FIRST, num_pages=3)
    _fill_random(pool, seed=5)
    out = torch.empty(pool.page_bytes, dtype=torch.uint8)
    assert pool.get_page_flat(2, out=out) is out
    assert torch.equal(out, pool.get_page_flat(2))
    with pytest.raises(InvalidArgument, match=f"{pool.page_bytes} bytes"):
        pool.get_page_flat(2, out=torch.empty(pool.page_bytes, dtype=torch.int8))
    with pytest.raises(InvalidArgument, match="contiguous"):
        pool.get_page_flat(2, out=torch.empty(2 * pool.page_bytes, dtype=torch.uint8)[::2])


def test_set_page_accepts_bytes_and_typed_tensors(make_pool: MakePool) -> None:
    pool = make_pool(mha_spec(), HostLayout.PAGE_FIRST_DIRECT, num_pages=3)
    data = bytes(range(256)) * (pool.page_bytes // 256) + bytes(pool.page_bytes % 256)
    pool.set_page_flat(0, data)
    assert bytes(pool.get_page_flat(0).numpy()) == data
    typed = torch.arange(pool.page_bytes // 2, dtype=torch.int16)
    pool.set_page_flat(1, typed)
    assert torch.equal(pool.get_page_flat(1), typed.view(torch.uint8))
    pool.set_page_flat(2, memoryview(bytearray(data)))
    assert bytes(pool.get_page_flat(2).numpy()) == data


def test_bad_page_access_raises_and_writes_nothing(make_pool: MakePool) -> None:
    pool = make_pool(mla_spec(), HostLayout.PAGE_FIRST, num_pages=3)
    _fill_random(pool, seed=1)
    before = [pool.get_page_flat(i) for i in range(pool.total_pages)]
    with pytest.raises(InvalidArgument, match=f"{pool.page_bytes - 1} bytes"):
        pool.set_page_flat(1, bytes(pool.page_bytes - 1))
    with pytest.raises(OutOfRange, match="page 4 is out of range"):
        pool.set_page_flat(4, bytes(pool.page_bytes))
    with pytest.raises(OutOfRange, match="page -1"):
        pool.get_page_flat(-1)
    with pytest.raises(OutOfRange, match="layer 3"):
        pool.kv_layer_pages(0, 3)
    with pytest.raises(OutOfRange, match="kv index 1"):
        pool.kv_layer_pages(1, 0)
    with pytest.raises(InvalidArgument, match="str"):
        pool.set_page_flat(0, "text")  # type: ignore[arg-type]
    assert all(torch.equal(pool.get_page_flat(i), before[i]) for i in range(pool.total_pages))


def test_padding_page_exists_and_is_never_allocated(make_pool: MakePool) -> None:
    pool = make_pool(mha_spec(), HostLayout.PAGE_FIRST, num_pages=5)
    assert pool.total_pages == 6
    assert pool.allocator.capacity == 5
    pages = pool.allocator.alloc(5)
    assert pages is not None and pool.num_pages not in pages.tolist()
    assert pool.allocator.alloc(1) is None
    pool.get_page_flat(pool.num_pages)  # the padding page is addressable


def test_required_bytes_and_segment_size(make_pool: MakePool) -> None:
    spec = mha_spec()
    pool = make_pool(spec, HostLayout.LAYER_FIRST, num_pages=7)
    assert MHAHostPool.required_bytes(spec, HostLayout.LAYER_FIRST, 7) == HEADER_BYTES + 8 * spec.page_bytes
    assert pool.segment.size == HEADER_BYTES + 8 * spec.page_bytes
    assert pool.page_bytes == spec.page_bytes


def test_registry_maps_each_kind_to_its_class(make_pool: MakePool) -> None:
    assert {PoolKind.MHA: MHAHostPool, PoolKind.MLA: MLAHostPool} == POOL_CLASSES
    assert isinstance(make_pool(mla_spec()), MLAHostPool)
    assert isinstance(make_pool(mha_spec()), MHAHostPool)


def test_warm_reopen_keeps_page_data(shm_name: Callable[[], str]) -> None:
    spec, name = mha_spec(), shm_name()
    pool = create_host_pool(spec, HostLayout.PAGE_FIRST, 4, segment_name=name)
    _fill_random(pool, seed=11)
    saved = [pool.get_page_flat(i) for i in range(pool.total_pages)]
    pool.close()
    again = open_host_pool(spec, HostLayout.PAGE_FIRST, 4, segment_name=name)
    try:
        assert all(torch.equal(again.get_page_flat(i), saved[i]) for i in range(again.total_pages))
        assert again.allocator.available() == 4
        again.allocator.mark_allocated(np.array([2]))
        assert again.allocator.alloc(3).tolist() == [0, 1, 3]  # type: ignore[union-attr]
    finally:
        again.close()


def test_reopen_with_another_shape_is_refused(shm_name: Callable[[], str]) -> None:
    name = shm_name()
    pool = create_host_pool(mha_spec(), HostLayout.PAGE_FIRST, 4, segment_name=name)
    pool.close()
    with pytest.raises(FailedPrecondition, match="layout: stored 'page_first', wanted 'layer_first'"):
        open_host_pool(mha_spec(), HostLayout.LAYER_FIRST, 4, segment_name=name)
    with pytest.raises(FailedPrecondition, match="bytes"):
        open_host_pool(mha_spec(), HostLayout.PAGE_FIRST, 5, segment_name=name)
    other = KVSpec(PoolKind.MHA, torch.float16, 3, 2, 4, 4)
    with pytest.raises(FailedPrecondition, match="dtype: stored 'bfloat16', wanted 'float16'"):
        open_host_pool(other, HostLayout.PAGE_FIRST, 4, segment_name=name)
    with pytest.raises(NotFound):
        open_host_pool(mha_spec(), HostLayout.PAGE_FIRST, 4, segment_name=shm_name())


def test_incomplete_segment_is_not_a_pool(shm_name: Callable[[], str]) -> None:
    name = shm_name()
    spec = mha_spec()
    size = MHAHostPool.required_bytes(spec, HostLayout.PAGE_FIRST, 4)
    with SharedSegment.create(name, size):
        pass
    with pytest.raises(FailedPrecondition, match="not a complete"):
        open_host_pool(spec, HostLayout.PAGE_FIRST, 4, segment_name=name)


def test_create_refuses_taken_name_and_bad_sizes(shm_name: Callable[[], str]) -> None:
    name = shm_name()
    pool = create_host_pool(mha_spec(), HostLayout.PAGE_FIRST, 2, segment_name=name)
    try:
        with pytest.raises(AlreadyExists, match=name):
            create_host_pool(mla_spec(), HostLayout.PAGE_FIRST, 2, segment_name=name)
        assert pool.get_page_flat(0).numel() == pool.page_bytes  # the first pool is intact
    finally:
        pool.close()
    fresh = shm_name()
    with pytest.raises(InvalidArgument, match="num_pages=0"):
        create_host_pool(mha_spec(), HostLayout.PAGE_FIRST, 0, segment_name=fresh)
    with pytest.raises(InvalidArgument, match="'page_head'"):
        create_host_pool(mha_spec(), "page_head", 2, segment_name=fresh)  # type: ignore[arg-type]
    assert not SharedSegment.exists(fresh)


def test_close_is_idempotent_and_leaves_the_name(make_pool: MakePool) -> None:
    pool = make_pool()
    view = pool.kv_layer_pages(0, 0)
    view[1] = 3.0
    pool.close()
    pool.close()
    assert SharedSegment.exists(pool.segment.name)
    assert bool((view[1] == 3.0).all())  # a live view keeps the mapping; it never dangles
    with pytest.raises(FailedPrecondition, match="closed"):
        pool.get_page_flat(0)
    with pytest.raises(FailedPrecondition, match="closed"):
        pool.kv_layer_pages(0, 0)


def test_pinning_happens_exactly_when_cuda_is_present(make_pool: MakePool) -> None:
    pool = make_pool(pin=False)  # CUDA refuses to register the same memory twice
    cuda = torch.cuda.is_available()
    unpin = pin_host_memory(pool.buffer[:1])
    assert (unpin is not None) == cuda
    if unpin is not None:
        unpin()
        unpin()  # idempotent
    assert pool.pin() is cuda
    pool.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_is_pinned_on_cuda(make_pool: MakePool) -> None:
    pool = make_pool(num_pages=64)
    assert pool.pin() is True
    assert pool.buffer.is_pinned()
    dev = torch.empty(pool.buffer.shape, dtype=pool.buffer.dtype, device="cuda")
    dev.copy_(pool.buffer, non_blocking=True)
    torch.cuda.synchronize()
    pool.close()
