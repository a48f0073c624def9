"""A cold prefix restored through the content index: L3 (file backend) -> L2 -> the worker.

``l3_restore_gbps`` (GB/s, 10**9 bytes per second): the pages of a prefix are
backed up from an L2 host pool into the ``file`` backend by the content index
(``write_through``, flushed, slab files fdatasync'ed), dropped from L2
(``reclaim``) and from the page cache (``posix_fadvise(DONTNEED)``), then the
timed part: one :meth:`~hicached.index.ContentIndex.prefetch` of every key
(cold L3 reads into fresh L2 pages; each batch is published as it lands) while
the worker takes every landed batch at once: pin, gather of its pages
(``index_select`` into a preallocated worker buffer of one batch; on a machine
without a GPU this copy stands for the worker's H2D load), unpin; it ends when
the worker holds the last page. The last batch the worker received is checked byte for byte
against what was backed up (untimed). The l3 suite divides it by the raw cold sequential read of the
same bytes measured in the same repetition (``l3_restore_vs_disk``).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from hicached.bench.timing import drop_cache, gbps, timed
from hicached.index import ContentIndex, IndexOptions, PrefetchPolicy, PrefetchState, WritePolicy
from hicached.l2 import HostLayout, HostPoolGroup, KVSpec, PoolEntry, PoolKind, create_host_pool
from hicached.l3.file import FileBackend, FileBackendConfig

__all__ = ["SPEC", "host_group", "restore_gbps"]

BATCH = 128
# (k + v) * 8 heads * 64 dims * 8 layers * 2 bytes * 4 tokens = 64 KiB per page.
SPEC = KVSpec(PoolKind.MHA, torch.float16, num_layers=8, num_heads=8, head_dim=64, page_size=4)


@contextlib.contextmanager
def host_group(num_pages: int) -> Iterator[HostPoolGroup]:
    """An L2 host pool of ``num_pages`` 64 KiB pages in a fresh shared-memory segment."""
    name = f"hicached-bench-restore-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    pool = create_host_pool(SPEC, HostLayout.PAGE_FIRST, num_pages, segment_name=name, pin=False)
    try:
        yield HostPoolGroup([PoolEntry("kv", pool, is_primary_index_anchor=True)])
    finally:
        pool.close()
        pool.unlink()


def restore_gbps(group: HostPoolGroup, source: memoryview, num_pages: int, root: Path) -> float:
    """Back up ``num_pages`` pages (cycled from ``source``) to a fresh file backend under
    ``root``, drop them from L2 and the page cache, and time their restore to a worker buffer."""
    pool = group.anchor.host_pool
    page_bytes = SPEC.page_bytes
    distinct = source.nbytes // page_bytes
    keys = [f"prefix-{i:08x}" for i in range(num_pages)]
    # The pool's pages as rows of int64 (one row per page of K, one of V): a gather on a wide
    # element type runs at memcpy speed (on uint8 views ~10x slower), as the copy engine's does.
    rows = pool.buffer.view(SPEC.num_kv, pool.total_pages, -1).view(torch.int64)
    workers = {BATCH: torch.ones(SPEC.num_kv, BATCH, rows.shape[2], dtype=torch.int64)}  # faulted in
    backend = FileBackend(FileBackendConfig(path=str(root), capacity_bytes=4 * num_pages * page_bytes))
    index = ContentIndex(
        group,
        namespace="bench",
        backend=backend,
        options=IndexOptions(write_policy=WritePolicy.WRITE_THROUGH),
    )
    try:
        pages = pool.allocator.alloc(num_pages)
        if pages is None:
            raise RuntimeError(f"the bench host pool has no {num_pages} free pages")
        for n, page in enumerate(pages.tolist()):
            j = n % distinct
            pool.set_page_flat(page, source[j * page_bytes : (j + 1) * page_bytes])
        for start in range(0, num_pages, BATCH):
            index.publish(keys[start : start + BATCH], {"kv": pages[start : start + BATCH]})
        index.flush()
        backend.sync()
        if index.reclaim("kv", num_pages) != num_pages:
            raise RuntimeError("the bench prefix did not leave L2")
        drop_cache(sorted(root.glob("slab-*.dat")))

        last = [0, 0]  # the keys the worker buffer holds now

        def to_worker(start: int, stop: int) -> None:
            """Pin the landed keys ``[start, stop)`` and copy their pages to the worker buffer."""
            last[:] = [start, stop]
            pin = index.pin(keys[start:stop])
            try:
                if len(pin) != stop - start:
                    raise RuntimeError(f"bench restore left {len(pin)} of {stop - start} pages in L2")
                out = workers.get(stop - start)
                if out is None:  # a last, partial batch
                    out = workers[stop - start] = torch.empty(
                        SPEC.num_kv, stop - start, rows.shape[2], dtype=torch.int64
                    )
                torch.index_select(rows, 1, torch.from_numpy(pin.pages["kv"]), out=out)
            finally:
                index.unpin(pin)

        def restore() -> None:
            task = index.prefetch(keys, policy=PrefetchPolicy.WAIT_COMPLETE)
            taken = 0
            while taken < num_pages:
                status = task.next_status(taken)
                landed = status.completed_pages
                if landed <= taken and status.state is not PrefetchState.RUNNING:
                    raise RuntimeError(f"bench restore ended {status} after {taken} pages")
                for start in range(taken, landed, BATCH):  # the worker takes what has landed
                    to_worker(start, min(start + BATCH, landed))
                taken = max(taken, landed)

        seconds = timed(restore)
        held = workers[last[1] - last[0]]
        got = b"".join(
            held[kv, k].numpy().tobytes() for k in range(held.shape[1]) for kv in range(SPEC.num_kv)
        )
        want = b"".join(
            source[(n % distinct) * page_bytes : (n % distinct + 1) * page_bytes] for n in range(*last)
        )
        if got != want:
            raise RuntimeError("bench restore delivered other bytes than were backed up")
    finally:
        index.close()
        backend.close()
    return gbps(num_pages * page_bytes, seconds)
