"""Fixtures of the data-plane tests: real memfd device pools, real host pools, unique names."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from hicached_client.export import ShmKVPool, dtype_from_wire
from hicached_client.v1 import types_pb2

from hicached.l2.host_pool import HostKVPool, create_host_pool
from hicached.l2.layout import HostLayout, KVSpec, PoolKind
from hicached.transfer import BufferSpec, DeviceMappings, DevicePoolView, FdBufferHandle, Medium

PAGE = 4
HEADS = 2
DIM = 8


def spec_of(kind: PoolKind = PoolKind.MHA, layers: int = 2, dtype: torch.dtype = torch.bfloat16) -> KVSpec:
    heads = 1 if kind is PoolKind.MLA else HEADS
    return KVSpec(kind=kind, dtype=dtype, num_layers=layers, num_heads=heads, head_dim=DIM, page_size=PAGE)


def buffer_spec(buf: types_pb2.DeviceBuffer, fd_map: dict[int, int] | None = None) -> BufferSpec:
    """The server's wire -> BufferSpec conversion, for fd buffers (tests only).

    Before attach, ``fd_index`` holds the exporting process's fd number: in this
    process that IS the fd; ``fd_map`` translates another process's numbers to the
    fds received from it.
    """
    h = buf.handle.fd
    fd = h.fd_index if fd_map is None else fd_map[h.fd_index]
    return BufferSpec(
        handle=FdBufferHandle(fd=fd, offset=h.offset, size=h.size),
        shape=tuple(buf.shape),
        dtype=dtype_from_wire(buf.dtype),
    )


def fill_random(tensors: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        words = t.view(torch.int16)
        words.copy_(torch.randint(-(2**15), 2**15, words.shape, dtype=torch.int16, generator=gen))


def pages_of(t: torch.Tensor, page: int = PAGE) -> torch.Tensor:
    """(tokens, H, D) -> (pages, page, H, D) viewed as int16 for exact comparison."""
    return t.view(t.shape[0] // page, page, *t.shape[1:]).view(torch.int16)


@pytest.fixture
def unique() -> Callable[[str], str]:
    def make(what: str) -> str:
        return f"hct-{what}-{os.getpid()}-{uuid.uuid4().hex[:10]}"

    return make


@pytest.fixture
def make_host(unique: Callable[[str], str]) -> Iterator[Callable[..., HostKVPool]]:
    pools: list[HostKVPool] = []

    def make(spec: KVSpec, layout: HostLayout = HostLayout.LAYER_FIRST, pages: int = 16) -> HostKVPool:
        pool = create_host_pool(spec, layout, pages, segment_name=unique("host"), pin=False)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
        pool.unlink()


@pytest.fixture
def make_device(unique: Callable[[str], str]) -> Iterator[Callable[..., ShmKVPool]]:
    pools: list[ShmKVPool] = []

    def make(spec: KVSpec, pages: int = 12) -> ShmKVPool:
        pool = ShmKVPool(
            unique("dev"),
            num_layers=spec.num_layers,
            tokens=pages * spec.page_size,
            heads=spec.num_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            mla=spec.kind is PoolKind.MLA,
        )
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
        pool.unlink()


@pytest.fixture
def mappings() -> Iterator[DeviceMappings]:
    m = DeviceMappings()
    yield m
    m.close()


def open_view(
    pool: ShmKVPool, mappings: DeviceMappings, name: str = "kv", layer_ids: list[int] | None = None
) -> DevicePoolView:
    ks = pool.k_buffers()
    views = mappings.open_all([buffer_spec(b) for b in (*ks, *pool.v_buffers())])
    k, v = views[: len(ks)], views[len(ks) :]
    return DevicePoolView(
        name=name,
        k=k,
        v=v,
        page_size=PAGE,
        layer_ids=layer_ids if layer_ids is not None else list(range(len(k))),
        medium=Medium.CPU,
    )


def pages(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)
