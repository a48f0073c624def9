"""What a pool group costs the node, as ``host.budget`` counts it: its shared-memory segments
plus the daemon's own bookkeeping for their pages.

Before, the budget counted the segments only. The bookkeeping is per page, so a pool of tiny
pages cost many times its segment: a byte-only pool of 1-byte pages in a 128 MiB budget made
133 M pages, whose free-page stack alone took 1 GiB (RSS 251 MB -> 1.42 GB), and a content
index full of such pages would hold one Python entry per page (~0.4-2.5 KB each). Charging
the bookkeeping makes the budget bound the memory whatever the page size: tiny pages get
proportionally fewer of them.

The constants list the arrays actually allocated; tests/core/test_footprint.py measures a
group and its index and fails when one grows past them (a new per-page array or entry field
must be added here).

Thread-safety: pure functions of their arguments.
"""

from __future__ import annotations

__all__ = [
    "ALLOCATING_PAGE_BYTES",
    "POOL_PAGE_BYTES",
    "bookkeeping_bytes",
    "entry_bytes",
]

# Per page of every pool, derived ones included (each is sized by total_pages, the padding
# page counted, or by num_pages, one less):
#   PageAllocator._stack      int64  8   hicached/l2/allocator.py (a derived pool has one too)
#   PageAllocator._allocated  bool   1   hicached/l2/allocator.py
#   PageAllocator._writer     int64  8   hicached/l2/allocator.py (whose bytes a free page holds)
#   GroupState._busy          int32  4   hicached/core/group_state.py
#   GroupState._pending       bool   1   hicached/core/group_state.py
POOL_PAGE_BYTES = 8 + 1 + 8 + 4 + 1

# Per page of every allocating (not derived) pool besides:
#   PageOwners._owner         int32  4   hicached/core/ledger.py (one table for all sessions)
#   EntryTable._owned         bool   1   hicached/index/table.py
ALLOCATING_PAGE_BYTES = 4 + 1

# One content-index entry (hicached/index/table.py, entries.py), without its key: the Entry
# object, its OrderedDict slot and linked-list node, and the page tuple. Measured with one
# allocating pool: 300 bytes by tracemalloc, ~480 of a daemon's RSS (malloc's headers and
# rounding, the key's included); 40 more per further pool (page numbers above 256 are int
# objects of their own). Charged with a margin: RSS depends on the allocator.
_ENTRY_BYTES = 640
_ENTRY_BYTES_PER_POOL = 48
# A key of n UTF-8 bytes is a str of at most n characters; one character beyond U+FFFF makes
# CPython store every character in 4 bytes, behind an 80-byte header.
_KEY_HEADER_BYTES = 80


def bookkeeping_bytes(pages: int, *, allocating: bool) -> int:
    """Bytes of the per-page arrays of a pool of ``pages`` usable pages (padding page counted)."""
    return (pages + 1) * (POOL_PAGE_BYTES + (ALLOCATING_PAGE_BYTES if allocating else 0))


def entry_bytes(allocating_pools: int, max_key_bytes: int) -> int:
    """Most bytes one content-index entry takes: a group's index holds at most one per page
    of its anchor pool (every key holds a page of each allocating pool), with keys of at most
    ``max_key_bytes`` (``limits.max_key_bytes``)."""
    key = _KEY_HEADER_BYTES + 4 * max_key_bytes
    return _ENTRY_BYTES + _ENTRY_BYTES_PER_POOL * max(0, allocating_pools - 1) + key
