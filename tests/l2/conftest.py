"""Fixtures for the L2 tests: uniquely named shared-memory segments, cleaned up afterwards."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator, Mapping

import pytest
import torch

from hicached.l2 import HostKVPool, HostLayout, KVSpec, PoolKind, SharedSegment, create_host_pool


@pytest.fixture
def shm_name() -> Iterator[Callable[[], str]]:
    """Factory of segment names unique to this process and test; every name is unlinked at teardown."""
    names: list[str] = []

    def make() -> str:
        name = f"hicached-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        names.append(name)
        return name

    yield make
    for name in names:
        path = os.path.join("/dev/shm", name)
        if os.path.exists(path):
            os.unlink(path)
    for name in names:
        assert not SharedSegment.exists(name)


def mha_spec(layers: int = 3, heads: int = 2, head_dim: int = 4, page_size: int = 4) -> KVSpec:
    return KVSpec(PoolKind.MHA, torch.bfloat16, layers, heads, head_dim, page_size)


def mla_spec(layers: int = 3, dim: int = 6, page_size: int = 4) -> KVSpec:
    return KVSpec(PoolKind.MLA, torch.float16, layers, 1, dim, page_size)


@pytest.fixture
def make_pool(shm_name: Callable[[], str]) -> Iterator[Callable[..., HostKVPool]]:
    """Factory of small real pools; all are closed at teardown (names unlinked by ``shm_name``)."""
    pools: list[HostKVPool] = []

    def make(
        spec: KVSpec | None = None,
        layout: HostLayout = HostLayout.PAGE_FIRST,
        num_pages: int = 8,
        pin: bool = True,
    ) -> HostKVPool:
        pool = create_host_pool(spec or mha_spec(), layout, num_pages, segment_name=shm_name(), pin=pin)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


class PoolReclaimer:
    """A :class:`~hicached.l2.group.Reclaimer` made of one function per pool: it says any
    allocated page of those pools may be reclaimed (the group caps that by what is allocated)."""

    def __init__(self, reclaims: Mapping[str, Callable[[int], int]]) -> None:
        self.reclaims = dict(reclaims)

    def reclaimable(self, pool: str, wanted: int) -> int:
        return wanted if pool in self.reclaims else 0

    def reclaim(self, pool: str, pages_needed: int) -> int:
        return self.reclaims[pool](pages_needed)

    def leaving(self, pool: str) -> int:
        return 0
