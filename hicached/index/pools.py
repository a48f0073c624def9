"""The content index's view of one host pool group.

The index stores one page per *independent* pool for every key; a derived
pool (``indices_from_pool``) has no pages of its own but its bytes at the
source pool's page index belong to the key too, so they travel to and from
L3 with it. :class:`GroupView` fixes that mapping once, in pool-name order.

Thread-safety: immutable after construction; the pools' allocators are
thread-safe and page bytes are only touched by whoever holds the page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from hicached.errors import InvalidArgument, NotFound, clip
from hicached.l2.allocator import PageAllocator, PageArray
from hicached.l2.group import HostPoolGroup
from hicached.l2.host_pool import HostKVPool
from hicached.l3.base import StorageBackend

__all__ = ["FreePages", "GroupView", "PoolSlot"]

# Frees pages of the named pool that the index held (see GroupView.free).
FreePages = Callable[[str, PageArray], object]


@dataclasses.dataclass(frozen=True)
class PoolSlot:
    """One pool of the group: ``source`` is the column of the page index it reads."""

    name: str
    pool: HostKVPool
    source: int


class GroupView:
    """Independent pools (columns of an entry's page tuple) and every pool's byte source.

    ``free_pages``: how the pages the index held go back to their pool. The daemon gives the
    group's own free, which defers a page while a copy still reads or writes it (a session's
    copy queued before it published the page must not land in the page's next owner's data);
    without it, straight to the allocator.
    """

    def __init__(self, group: HostPoolGroup, free_pages: FreePages | None = None) -> None:
        self._free_pages = free_pages
        entries = group.entries
        if not entries:
            raise InvalidArgument("the host pool group has no pools")
        self.group = group
        self.alloc_names: tuple[str, ...] = tuple(e.name for e in entries if e.indices_from_pool is None)
        self.allocators: tuple[PageAllocator, ...] = tuple(
            group.get_pool(n).allocator for n in self.alloc_names
        )
        column = {name: i for i, name in enumerate(self.alloc_names)}
        self.slots: tuple[PoolSlot, ...] = tuple(
            PoolSlot(e.name, e.host_pool, column[e.indices_from_pool or e.name]) for e in entries
        )
        self.page_size = group.anchor.host_pool.page_size
        # Bytes that one key occupies across every pool (what moves to/from L3).
        self.key_bytes = sum(s.pool.page_bytes for s in self.slots)

    def free(self, column: int, pages: PageArray) -> None:
        """Give pages of ``column`` the index held back to their pool (see the class docstring)."""
        if self._free_pages is None:
            self.allocators[column].free(pages)
        else:
            self._free_pages(self.alloc_names[column], pages)

    def column(self, pool: str) -> int:
        """The page-tuple column a pool's pages come from (a derived pool maps to its source)."""
        for slot in self.slots:
            if slot.name == pool:
                return slot.source
        raise NotFound(f"host pool {clip(pool)} is not in this group (known: {[s.name for s in self.slots]})")

    def l3_keys(self, namespace: str, keys: Sequence[str]) -> list[str]:
        """Backend keys, key-major (every pool of key 0, then key 1, ...), so that the
        backend's leading-run answers map onto whole keys."""
        return [f"{namespace}/{slot.name}/{key}" for key in keys for slot in self.slots]

    def chunks(self, rows: Sequence[Sequence[int]]) -> list[list[memoryview]]:
        """Byte views of each key's page in each pool, in :meth:`l3_keys` order."""
        return [slot.pool.page_chunks(row[slot.source]) for row in rows for slot in self.slots]

    def l3_run(self, backend: StorageBackend, namespace: str, keys: Sequence[str]) -> int:
        """Leading run of ``keys`` with every pool's part in ``backend`` (its answer is per object)."""
        return backend.exists(self.l3_keys(namespace, keys)) // len(self.slots) if keys else 0

    def cached(
        self, backend: StorageBackend | None, namespace: str, keys: Sequence[str], in_l2: Sequence[bool]
    ) -> list[bool]:
        """Per key: in L2 (``in_l2``), or every pool's part in ``backend`` (one request asks
        it for all the other keys)."""
        cached = list(in_l2)
        need = [i for i, hit in enumerate(in_l2) if not hit]
        if backend is not None and need:
            found = self.whole_keys(backend.present(self.l3_keys(namespace, [keys[i] for i in need])))
            for i, hit in zip(need, found, strict=True):
                cached[i] = hit
        return cached

    def whole_keys(self, results: Sequence[bool]) -> list[bool]:
        """Per key: True when every pool's part succeeded."""
        p = len(self.slots)
        return [all(results[i : i + p]) for i in range(0, len(results), p)]
