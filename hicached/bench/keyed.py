"""Content-index (key-addressed cache) costs beside plain baselines, measured in one run.

Index operations run on real shared-memory host pools, in batches of 128
keys (the reference's batch size); L3 paths move 64 KiB pages:

* ``index_publish_keys_per_s`` / ``index_pin_keys_per_s`` /
  ``index_lookup_keys_per_s``: :class:`~hicached.index.ContentIndex` publish,
  pin+unpin and lookup (L2 only), keys per second.
* ``dict_insert_keys_per_s``: inserting the same keys into a plain ``dict``,
  the floor of any Python index (the ratio shows the index's bookkeeping cost).
* ``index_backup_gbps`` / ``index_prefetch_gbps``: L2 -> L3 backup (publish +
  flush, ``write_through``) and L3 -> L2 prefetch (``wait_complete``) through
  the index into the ``file`` backend in a temporary directory.
* ``file_set_from_gbps`` / ``file_get_into_gbps``: the same pages moved by
  the backend directly (``set_from``/``get_into`` of the same chunks), the
  limit for the two figures above.

GB/s are 10**9 bytes per second. Nothing is printed; the ``hicached bench``
command renders the table.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from hicached.bench.timing import timed
from hicached.index import ContentIndex, IndexOptions, PrefetchPolicy, PrefetchState, WritePolicy
from hicached.l2 import HostLayout, HostPoolGroup, KVSpec, PoolEntry, PoolKind, create_host_pool
from hicached.l3 import create_backend

__all__ = ["run"]

BATCH = 128
# (k + v) * 8 heads * 64 dims * 8 layers * 2 bytes * 4 tokens = 64 KiB per page.
SPEC = KVSpec(PoolKind.MHA, torch.float16, num_layers=8, num_heads=8, head_dim=64, page_size=4)
# Index bookkeeping does not touch page bytes: tiny pages keep many keys cheap to host.
TINY_SPEC = KVSpec(PoolKind.MHA, torch.float16, num_layers=1, num_heads=1, head_dim=8, page_size=4)


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


@contextlib.contextmanager
def _group(num_pages: int, spec: KVSpec = SPEC) -> Iterator[HostPoolGroup]:
    name = f"hicached-bench-keyed-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    pool = create_host_pool(spec, HostLayout.PAGE_FIRST, num_pages, segment_name=name, pin=False)
    try:
        yield HostPoolGroup([PoolEntry("kv", pool, is_primary_index_anchor=True)])
    finally:
        pool.close()
        pool.unlink()


def _keys(tag: str, n: int) -> list[str]:
    return [f"{tag}{i:08x}" for i in range(n)]


def _index_ops(num_pages: int) -> dict[str, float]:
    with _group(num_pages, TINY_SPEC) as group:
        index = ContentIndex(group, namespace="bench", backend=None)
        try:
            allocator = group.anchor.host_pool.allocator
            keys = _keys("k", num_pages)
            pages = allocator.alloc(num_pages)
            assert pages is not None
            batches: list[tuple[list[str], np.ndarray]]
            batches = [(keys[i : i + BATCH], pages[i : i + BATCH]) for i in range(0, num_pages, BATCH)]

            def publish() -> None:
                for batch_keys, batch_pages in batches:
                    index.publish(batch_keys, {"kv": batch_pages})

            def pin() -> None:
                for batch_keys, _ in batches:
                    index.unpin(index.pin(batch_keys))

            def lookup() -> None:
                for batch_keys, _ in batches:
                    index.lookup(batch_keys)

            # Best of three rounds; the first also pays one-off costs (imports, first touch).
            publish_s = pin_s = lookup_s = float("inf")
            for _ in range(3):
                publish_s = min(publish_s, timed(publish))
                pin_s = min(pin_s, timed(pin))
                lookup_s = min(lookup_s, timed(lookup))
                index.clear()
                fresh = allocator.alloc(num_pages)
                assert fresh is not None
                batches = [(keys[i : i + BATCH], fresh[i : i + BATCH]) for i in range(0, num_pages, BATCH)]

            def dict_insert() -> None:
                table: dict[str, tuple[int, ...]] = {}
                for batch_keys, batch_pages in batches:
                    for key, page in zip(batch_keys, batch_pages.tolist(), strict=True):
                        table[key] = (page,)

            dict_s = min(timed(dict_insert) for _ in range(3))
            allocator.free(np.concatenate([p for _, p in batches]))
        finally:
            index.close()
    return {
        "index_publish_keys_per_s": _rate(num_pages, publish_s),
        "index_pin_keys_per_s": _rate(num_pages, pin_s),
        "index_lookup_keys_per_s": _rate(num_pages, lookup_s),
        "dict_insert_keys_per_s": _rate(num_pages, dict_s),
    }


def _l3_paths(num_pages: int, root: Path, rounds: int = 3) -> dict[str, float]:
    """Best of ``rounds``; the direct and the index runs alternate which goes first, so
    neither always meets a page cache the other just filled."""
    nbytes = num_pages * SPEC.page_bytes
    best = {"set": float("inf"), "get": float("inf"), "backup": float("inf"), "prefetch": float("inf")}
    # Half the pool is the direct runs' pages, half is for the index to own.
    with _group(2 * num_pages) as group:
        pool = group.anchor.host_pool
        allocator = pool.allocator
        pages = allocator.alloc(num_pages)
        assert pages is not None
        rng = np.random.default_rng(0)
        for page in pages.tolist():
            pool.set_page_flat(page, rng.integers(0, 256, SPEC.page_bytes, dtype=np.uint8).tobytes())
        chunks = [pool.page_chunks(p) for p in pages.tolist()]
        backend = create_backend("file", {"path": str(root / "l3")})
        index = ContentIndex(
            group,
            namespace="bench",
            backend=backend,
            options=IndexOptions(write_policy=WritePolicy.WRITE_THROUGH),
        )
        try:

            def direct(r: int) -> None:
                keys = _keys(f"direct/{r}/", num_pages)
                spans = range(0, num_pages, BATCH)
                best["set"] = min(
                    best["set"],
                    timed(
                        lambda: [backend.set_from(keys[i : i + BATCH], chunks[i : i + BATCH]) for i in spans]
                    ),
                )
                best["get"] = min(
                    best["get"],
                    timed(
                        lambda: [backend.get_into(keys[i : i + BATCH], chunks[i : i + BATCH]) for i in spans]
                    ),
                )

            def through_index(r: int) -> None:
                content = _keys(f"c{r}-", num_pages)
                owned = allocator.alloc(num_pages)
                assert owned is not None

                def backup() -> None:
                    for i in range(0, num_pages, BATCH):
                        index.publish(content[i : i + BATCH], {"kv": owned[i : i + BATCH]})
                    index.flush()

                best["backup"] = min(best["backup"], timed(backup))
                index.reclaim("kv", num_pages)

                def prefetch() -> None:
                    task = index.prefetch(content, policy=PrefetchPolicy.WAIT_COMPLETE)
                    if task.wait().state is not PrefetchState.DONE:
                        raise RuntimeError(f"bench prefetch ended {task.status()}")

                best["prefetch"] = min(best["prefetch"], timed(prefetch))
                index.reclaim("kv", num_pages)

            for r in range(rounds):
                order = (direct, through_index) if r % 2 == 0 else (through_index, direct)
                for step in order:
                    step(r)
        finally:
            index.close()
            backend.close()
            allocator.free(pages)
    return {
        "index_backup_gbps": nbytes / best["backup"] / 1e9,
        "file_set_from_gbps": nbytes / best["set"] / 1e9,
        "index_prefetch_gbps": nbytes / best["prefetch"] / 1e9,
        "file_get_into_gbps": nbytes / best["get"] / 1e9,
    }


def run(quick: bool) -> dict[str, float]:
    """Index throughput (keys/s) and L3 paths through the index vs the backend (GB/s)."""
    ops_pages = 4096 if quick else 65536
    l3_pages = 256 if quick else 2048
    results = _index_ops(ops_pages)
    with tempfile.TemporaryDirectory(prefix="hicached-bench-keyed-") as tmp:
        results.update(_l3_paths(l3_pages, Path(tmp)))
    return results
