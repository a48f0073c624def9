"""Every page is freed exactly once and a pinned page is never freed: random operation
sequences (hypothesis) and a threaded stress run, on real pools and the real file backend."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicached.index import ContentIndex, IndexOptions, Pin, WritePolicy
from hicached.l2 import HostKVPool, HostLayout, HostPoolGroup, PoolEntry, create_host_pool
from hicached.l3 import create_backend

from .conftest import keys_of, mha_spec, page_pattern, read_page, write_pages

CAPACITY = 10

op = st.one_of(
    st.tuples(st.just("publish"), st.sampled_from("abc"), st.integers(1, 4), st.sampled_from(["", "t"])),
    st.tuples(st.just("pin"), st.sampled_from("abc"), st.integers(1, 4)),
    st.tuples(st.just("unpin"), st.integers(0, 7)),
    st.tuples(st.just("reclaim"), st.sampled_from(["kv", "swa", "draft"]), st.integers(0, CAPACITY)),
    st.tuples(st.just("clear"), st.sampled_from([None, "", "t"])),
    st.tuples(st.just("resolve"), st.integers(1, 4)),
)


def build_group() -> tuple[HostPoolGroup, list[HostKVPool]]:
    pools = []
    for layout in (HostLayout.PAGE_FIRST, HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST):
        name = f"hicached-cache-prop-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        pools.append(create_host_pool(mha_spec(1), layout, CAPACITY, segment_name=name, pin=False))
    group = HostPoolGroup(
        [
            PoolEntry("kv", pools[0], is_primary_index_anchor=True),
            PoolEntry("swa", pools[1]),
            PoolEntry("draft", pools[2], indices_from_pool="kv"),
        ]
    )
    return group, pools


def check_invariants(
    index: ContentIndex, group: HostPoolGroup, pins: list[tuple[Pin, dict[str, bytes]]]
) -> None:
    owned = index.owned_pages()
    for name in ("kv", "swa"):
        allocator = group.get_pool(name).allocator
        # Nothing but the index holds pages between operations: allocated == owned.
        np.testing.assert_array_equal(allocator.allocated_pages(), owned[name])
    for pin, expected in pins:
        for i, key in enumerate(pin.keys):
            for name in ("kv", "swa"):
                page = int(pin.pages[name][i])
                assert page in set(owned[name].tolist()), f"pinned page of {key} was freed"
                assert read_page(group, name, page) == expected[f"{name}/{i}"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, max_size=25), policy=st.sampled_from(list(WritePolicy)))
def test_random_sequences_free_every_page_exactly_once(
    tmp_path: Path, ops: list[tuple[Any, ...]], policy: WritePolicy
) -> None:
    group, pools = build_group()
    backend = create_backend("file", {"path": str(tmp_path / uuid.uuid4().hex)})
    index = ContentIndex(
        group, namespace="prop", backend=backend, options=IndexOptions(write_policy=policy, batch_pages=3)
    )
    pins: list[tuple[Pin, dict[str, bytes]]] = []
    seed = 0
    try:
        for operation in ops:
            kind = operation[0]
            if kind == "publish":
                _, chain, n, tenant = operation
                seed += 1
                try:
                    pages = write_pages(group, n, seed=seed)
                except AssertionError:  # pool full: a worker would reclaim or give up
                    for name in ("kv", "swa"):
                        index.reclaim(name, 0)
                    continue
                mask = index.publish(keys_of(chain, n), pages, tenant=tenant)
                for name, arr in pages.items():
                    group.free(arr[~mask], pool=name)
            elif kind == "pin":
                _, chain, n = operation
                pin = index.pin(keys_of(chain, n))
                expected = {
                    f"{name}/{i}": read_page(group, name, int(pin.pages[name][i]))
                    for name in ("kv", "swa")
                    for i in range(len(pin))
                }
                pins.append((pin, expected))
            elif kind == "unpin" and pins:
                pin, _ = pins.pop(operation[1] % len(pins))
                index.unpin(pin)
            elif kind == "reclaim":
                index.reclaim(operation[1], operation[2])
            elif kind == "clear":
                index.clear(operation[1])
            elif kind == "resolve":
                got = group.alloc(operation[1], reclaim=True)
                if got is not None:
                    group.free(got)
            index.flush(timeout_s=30)
            check_invariants(index, group, pins)
    finally:
        index.close()
        for name in ("kv", "swa"):
            allocator = group.get_pool(name).allocator
            assert allocator.available() == CAPACITY
        backend.close()
        for pool in pools:
            pool.close()
            pool.unlink()


def test_threads_racing_publish_pin_reclaim_and_backup_leak_nothing(
    make_group: Callable[..., HostPoolGroup], tmp_path: Path
) -> None:
    group = make_group(32, sidecars=("swa",))
    backend = create_backend("file", {"path": str(tmp_path / "l3")})
    index = ContentIndex(group, namespace="race", backend=backend, options=IndexOptions(batch_pages=4))
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(tag: str) -> None:
        try:
            start.wait()
            for round_ in range(40):
                keys = keys_of(f"{tag}{round_ % 5}-", 4)
                pages = None
                for _ in range(3):
                    try:
                        pages = write_pages(group, 4, seed=seed_of(tag, round_ % 5))
                        break
                    except AssertionError:
                        index.reclaim("kv", 4)
                if pages is None:
                    continue
                mask = index.publish(keys, pages)
                for name, arr in pages.items():
                    group.free(arr[~mask], pool=name)
                other = (round_ + 1) % 5
                pin = index.pin(keys_of(f"{tag}{other}-", 4))
                for i in range(len(pin)):
                    for name in ("kv", "swa"):
                        page = int(pin.pages[name][i])
                        nbytes = group.get_pool(name).page_bytes
                        assert read_page(group, name, page) == page_pattern(
                            nbytes, seed_of(tag, other), i, name
                        )
                index.unpin(pin)
                if round_ % 7 == 0:
                    index.backup(keys)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def seed_of(tag: str, chain: int) -> int:
        # Every writer of a key writes the same bytes, whoever wins the publish.
        return ord(tag) * 10 + chain

    threads = [threading.Thread(target=worker, args=(t,)) for t in ("a", "b", "c", "d")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    index.flush(timeout_s=60)
    stats = index.stats()
    assert stats.pinned_entries == 0
    assert stats.queued_backup_pages == 0
    owned = index.owned_pages()
    for name in ("kv", "swa"):
        np.testing.assert_array_equal(group.get_pool(name).allocator.allocated_pages(), owned[name])
    index.close()
    for name in ("kv", "swa"):
        assert group.available(name) == 32
    backend.close()
