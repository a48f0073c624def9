"""What a pool group and its sessions cost the daemon per page, measured with tracemalloc."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from typing import TypeVar

from hicached_client import pool_spec

from hicached.core.types import PoolRequest, WorkerId
from hicached.server import convert

from .conftest import Core

T = TypeVar("T")

PAGES = 1 << 17


def byte_pools(pages: int) -> list[PoolRequest]:
    """kv (anchor) and swa (sidecar) allocate; draft derives from kv. Byte-only, 1-byte pages."""

    def spec(name: str, role: str, **extra: str) -> PoolRequest:
        msg = pool_spec(
            name, role=role, kind="mla", dtype="int8", page_size=1, num_layers=1, num_heads=1,
            head_dim=1, host_layout="layer_first", k_buffers=(), host_bytes=pages, **extra,
        )  # fmt: skip
        return convert.pool_request(msg, 0, [])

    return [spec("kv", "anchor"), spec("swa", "sidecar"), spec("draft", "derived", indices_from_pool="kv")]


def traced(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()`` and the bytes it left allocated (Python objects and numpy arrays alike)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = fn()
        gc.collect()
        return out, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_a_session_costs_its_group_nothing_per_page(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: every session kept a bool per page of each pool of its group (a
    second attach here allocated 393 KB; with 1-byte pages an attach cost as much as the pool,
    outside host.budget). Now the group keeps one owner table for all its sessions."""
    c = make_core()
    pools = byte_pools(PAGES)
    c.core.attach(WorkerId("a", 1, "m-footprint"), pools)
    result, grown = traced(lambda: c.core.attach(WorkerId("b", 1, "m-footprint"), pools))
    assert result.joined_existing_group
    assert grown < 64 << 10, f"a session of a group of {PAGES} pages cost {grown} bytes"
