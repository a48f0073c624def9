"""Fixtures for the content-index tests: real shared-memory host pools, the real file
backend in a temporary directory, and thin failure-injection wrappers around it."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicached.index import ContentIndex, IndexObserver, IndexOptions
from hicached.index.tenant_keys import TenantL3Keys
from hicached.l2 import HostKVPool, HostLayout, HostPoolGroup, KVSpec, PoolEntry, PoolKind, create_host_pool
from hicached.l3 import StorageBackend, create_backend
from hicached.l3.base import BackendStats
from hicached.testing.servers import RedisServer, redis_server

PAGE_SIZE = 4


def mha_spec(layers: int = 2) -> KVSpec:
    return KVSpec(PoolKind.MHA, torch.float16, layers, 2, 4, PAGE_SIZE)


@pytest.fixture
def make_group() -> Iterator[Callable[..., HostPoolGroup]]:
    """Factory of real pool groups: anchor ``kv`` plus optional sidecars; closed and unlinked after."""
    pools: list[HostKVPool] = []

    def make(
        num_pages: int = 16, *, sidecars: Sequence[str] = (), derived: Sequence[str] = ()
    ) -> HostPoolGroup:
        def pool(layout: HostLayout) -> HostKVPool:
            name = f"hicached-cache-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            p = create_host_pool(mha_spec(), layout, num_pages, segment_name=name, pin=False)
            pools.append(p)
            return p

        entries = [PoolEntry("kv", pool(HostLayout.PAGE_FIRST), is_primary_index_anchor=True)]
        entries += [PoolEntry(name, pool(HostLayout.LAYER_FIRST)) for name in sidecars]
        entries += [PoolEntry(name, pool(HostLayout.PAGE_FIRST), indices_from_pool="kv") for name in derived]
        return HostPoolGroup(entries)

    yield make
    for p in pools:
        p.close()
        p.unlink()


@pytest.fixture
def file_backend(tmp_path: Path) -> Iterator[StorageBackend]:
    backend = create_backend("file", {"path": str(tmp_path / f"l3-{uuid.uuid4().hex[:8]}")})
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def cache_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture(params=["file", "redis"])
def open_l3(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], StorageBackend]]:
    """Factory of backend instances over ONE store (a real file directory or a real
    redis-server with a key prefix of this test's own): a second instance sees what
    the first stored, as a restarted daemon would."""
    made: list[StorageBackend] = []
    if request.param == "file":
        options: dict[str, object] = {"path": str(tmp_path / f"l3-{uuid.uuid4().hex[:8]}")}
    else:
        server: RedisServer = request.getfixturevalue("cache_redis")
        options = {"port": server.port, "key_prefix": f"cache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}/"}

    def make() -> StorageBackend:
        for old in made:
            old.close()  # the file backend allows one open instance per directory
        made.append(create_backend(request.param, options))
        return made[-1]

    yield make
    if request.param == "redis":
        made[-1].clear()
    for backend in made:
        backend.close()


@pytest.fixture
def l3_backend(open_l3: Callable[[], StorageBackend]) -> StorageBackend:
    """A fresh real backend: the file backend and redis, each test run against both."""
    return open_l3()


class Wrapped(StorageBackend):
    """Delegates to a real backend; subclasses inject failures or gates."""

    name = "wrapped"

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner
        self.set_calls = 0
        self.get_calls = 0

    def exists(self, keys: Sequence[str]) -> int:
        return self.inner.exists(keys)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self.inner.get(keys)

    def set(self, keys: Sequence[str], values: Sequence[bytes | memoryview]) -> list[bool]:
        return self.inner.set(keys, values)

    def get_into(self, keys: Sequence[str], dests: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.get_calls += 1
        return self.inner.get_into(keys, dests)

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.set_calls += 1
        return self.inner.set_from(keys, srcs)

    def delete(self, keys: Sequence[str]) -> int:
        return self.inner.delete(keys)

    def clear(self, prefix: str = "") -> int:
        return self.inner.clear(prefix)

    def stats(self) -> BackendStats:
        return self.inner.stats()


class FailOnNthSet(Wrapped):
    """``set_from`` call number ``n`` (1-based) stores nothing and reports failure."""

    def __init__(self, inner: StorageBackend, n: int) -> None:
        super().__init__(inner)
        self.n = n

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.set_calls += 1
        if self.set_calls == self.n:
            return [False] * len(keys)
        return self.inner.set_from(keys, srcs)


class FailingSets(Wrapped):
    """Every ``set_from`` stores nothing and reports failure (an L3 that refuses writes)."""

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.set_calls += 1
        return [False] * len(keys)


class GatedGets(Wrapped):
    """Each ``get_into`` announces itself and then waits until the test opens the gate."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.entered = threading.Semaphore(0)
        self.gate = threading.Event()

    def get_into(self, keys: Sequence[str], dests: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.get_calls += 1
        self.entered.release()
        assert self.gate.wait(30), "test never opened the gate"
        return self.inner.get_into(keys, dests)


class GatedSets(Wrapped):
    """Each ``set_from`` waits until the test opens the gate."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.entered = threading.Semaphore(0)
        self.gate = threading.Event()

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.entered.release()
        assert self.gate.wait(30), "test never opened the gate"
        return super().set_from(keys, srcs)


@pytest.fixture
def make_index() -> Iterator[Callable[..., ContentIndex]]:
    """Factory of indexes; each is closed at teardown and must have left its pools full.
    Keyword arguments other than those named are :class:`IndexOptions` fields."""
    made: list[tuple[ContentIndex, HostPoolGroup]] = []

    def make(
        group: HostPoolGroup,
        backend: StorageBackend | None = None,
        *,
        namespace: str = "model-a",
        observer: IndexObserver | None = None,
        tenant_keys: TenantL3Keys | None = None,
        **options: Any,
    ) -> ContentIndex:
        index = ContentIndex(
            group,
            namespace=namespace,
            backend=backend,
            options=IndexOptions(**options),
            observer=observer,
            tenant_keys=tenant_keys,
        )
        made.append((index, group))
        return index

    yield make
    for index, group in made:
        index.close()
        for entry in group.entries:
            allocator = entry.host_pool.allocator
            if entry.indices_from_pool is None:
                assert allocator.available() == allocator.capacity, f"{entry.name} leaked pages"


def write_pages(group: HostPoolGroup, n: int, seed: int) -> dict[str, np.ndarray]:
    """Allocate ``n`` pages of every independent pool and fill them (derived pools too)
    with bytes determined by ``seed``; returns the pages per independent pool.
    AssertionError, with nothing allocated, when a pool is full."""
    pages: dict[str, np.ndarray] = {}
    for entry in group.entries:
        if entry.indices_from_pool is None:
            got = entry.host_pool.allocator.alloc(n)
            if got is None:
                for name, taken in pages.items():  # all or nothing, like a worker's resolve
                    group.free(taken, pool=name)
                raise AssertionError(f"pool {entry.name} is full")
            pages[entry.name] = got
    for entry in group.entries:
        source = pages[entry.indices_from_pool or entry.name]
        for i, page in enumerate(source.tolist()):
            entry.host_pool.set_page_flat(page, page_pattern(entry.host_pool.page_bytes, seed, i, entry.name))
    return pages


def page_pattern(nbytes: int, seed: int, i: int, pool: str) -> bytes:
    rng = np.random.default_rng([seed, i, sum(pool.encode())])
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def read_page(group: HostPoolGroup, pool: str, page: int) -> bytes:
    return bytes(group.get_pool(pool).get_page_flat(page).numpy())


def pin_bytes(group: HostPoolGroup, pages: dict[str, np.ndarray], i: int) -> dict[str, bytes]:
    """The bytes of the ``i``-th pinned key in every pool (derived ones through their source)."""
    out = {}
    for entry in group.entries:
        page = int(pages[entry.indices_from_pool or entry.name][i])
        out[entry.name] = read_page(group, entry.name, page)
    return out


def keys_of(tag: str, n: int) -> list[str]:
    return [f"{tag}{i:04d}" for i in range(n)]
