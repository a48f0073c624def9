"""Page allocator for one host pool.

Free pages sit on a stack (a preallocated int64 array), so ``alloc(n)`` and
``free(pages)`` cost O(n) in the pages moved, not in the pool's capacity. The
stack starts as ``capacity-1, ..., 1, 0`` with page 0 on top, so a fresh pool
hands out low, contiguous pages; freed pages are pushed back sorted so that the
next allocation gets them in ascending order (recently freed pages are reused
first, which keeps the hot set small).

A separate bitmap records which pages are allocated; it is what catches double
allocation (journal replay) and double free. Another array records, per free page, whose
bytes it may hold (:data:`CLEAN`, :data:`ANYONE`, or the tag of the owner that freed it), so
that a page is zeroed before it goes to anyone else (:meth:`PageAllocator.take_dirty`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hicached.errors import DoubleFree, FailedPrecondition, InvalidArgument, OutOfRange
from hicached.page_arrays import SMALL_BATCH, ascending

PageArray = npt.NDArray[np.int64]
PagesLike = PageArray | Sequence[int]

# A free page's last writer: nobody's bytes (never written, or zeroed since), or anyone's.
# Any other value is the tag of the owner that freed it (a positive int64 its caller never
# gives to another owner: hicached.core.sessions.Session.serial).
CLEAN = 0
ANYONE = -1


def as_page_array(pages: object, what: str = "page indices") -> PageArray:
    """A fresh 1-D int64 copy of ``pages``; InvalidArgument if it is not integral and 1-D."""
    if type(pages) is np.ndarray and pages.dtype == np.int64 and pages.ndim == 1:
        return pages.copy()  # the common case, without the checks' dozen numpy calls
    arr = np.asarray(pages)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be 1-D, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument(f"{what} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=True)


def first_repeat(pages: PageArray, ordered: PageArray | None = None) -> int | None:
    """The smallest page listed more than once in ``pages``, else None; ``ordered``, when
    the caller has it, is ``pages`` sorted (not sorted again).

    By sorting, not ``np.unique``: numpy 2's unique asks ``np.ma`` whether its input is
    masked, and the first such call in a process imports ``numpy.ma`` (7-12 ms, paid by
    the first request after a daemon start).
    """
    if len(pages) < 2:
        return None
    if len(pages) <= SMALL_BATCH:
        return first_repeat_of(pages.tolist())
    if ordered is None:
        if ascending(pages):
            return None
        ordered = np.sort(pages)
    repeats = np.flatnonzero(ordered[1:] == ordered[:-1])
    return int(ordered[repeats[0]]) if len(repeats) else None


def first_repeat_of(pages: list[int]) -> int | None:
    """:func:`first_repeat` of a list (for small batches)."""
    if len(set(pages)) == len(pages):
        return None
    seen: set[int] = set()
    repeats = []
    for p in pages:
        if p in seen:
            repeats.append(p)
        seen.add(p)
    return min(repeats)


def distinct(pages: PageArray) -> PageArray:
    """``pages`` sorted, each once (as ``np.unique``, without importing ``numpy.ma``)."""
    ordered = np.sort(pages)
    if len(ordered) < 2:
        return ordered
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


class PageAllocator:
    """Thread-safe allocator of page numbers ``0 .. capacity-1``.

    Thread-safety: every public method takes one internal lock, so calls are
    atomic with respect to each other.
    Atomicity: ``free`` and ``mark_allocated`` validate the whole request
    before changing anything; on error the allocator is unchanged.
    Ownership: every returned array is a fresh copy owned by the caller; the
    allocator never keeps a reference to an array it was given or returned.
    """

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        if not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidArgument(f"allocator capacity must be a non-negative page count, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidArgument(f"page_size must be a positive integer, got {page_size!r}")
        self.capacity = num_pages
        self.page_size = page_size
        self._lock = threading.Lock()
        # Per page: host.budget charges these two (hicached/core/footprint.py; keep in step).
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages
        self._allocated = np.zeros(num_pages, dtype=bool)
        # Per page, whose bytes it may hold: set when freed, CLEAN again once taken.
        self._writer = np.full(num_pages, CLEAN, dtype=np.int64)
        self._sealed = False

    def seal(self) -> None:
        """Hand out no page from now on (``alloc`` of any page None; ``available`` still counts
        the free ones, so nobody evicts to make room); frees are still taken. For a pool whose
        pages a warm-restart journal has listed: a page freed after the snapshot (the index's
        close frees them all) must not take a late call's bytes."""
        with self._lock:
            self._sealed = True

    @property
    def sealed(self) -> bool:
        return self._sealed

    def available(self) -> int:
        with self._lock:
            return self._top

    def allocated_count(self) -> int:
        with self._lock:
            return self.capacity - self._top

    def alloc(self, n: int) -> PageArray | None:
        """``n`` free pages (ascending where possible), or None when fewer than ``n`` are free."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise InvalidArgument(f"page count must be a non-negative integer, got {n!r}")
        n = int(n)
        with self._lock:
            if n > self._top or (self._sealed and n):
                return None
            pages = self._stack[self._top - n : self._top][::-1].copy()
            self._top -= n
            self._allocated[pages] = True
            return pages

    def alloc_tokens(self, n_tokens: int) -> PageArray | None:
        """Reference-compatible: ``n_tokens`` page-aligned token slot indices, or None."""
        if not isinstance(n_tokens, (int, np.integer)) or n_tokens < 0:
            raise InvalidArgument(f"token count must be a non-negative integer, got {n_tokens!r}")
        if n_tokens % self.page_size:
            raise InvalidArgument(
                f"token count {n_tokens} is not a multiple of the page size {self.page_size}"
            )
        pages = self.alloc(int(n_tokens) // self.page_size)
        return None if pages is None else pages_to_tokens(pages, self.page_size)

    def free(self, pages: PagesLike, *, by: int = ANYONE) -> int:
        """Return ``pages`` to the pool; the count freed. ``by``: the tag of the owner whose
        bytes they hold, when one owner alone could have written them (else :data:`ANYONE`).

        Raises OutOfRange, InvalidArgument (duplicates) or DoubleFree (a page
        that is not allocated), naming the offending page, and frees nothing.
        """
        arr = as_page_array(pages)
        with self._lock:
            ordered = self._check(arr, want_allocated=True)
            self._allocated[arr] = False
            self._writer[arr] = by if by > CLEAN else ANYONE
            n = arr.size
            # Descending onto the stack, so the next alloc pops them ascending.
            self._stack[self._top : self._top + n] = ordered[::-1]
            self._top += n
            return n

    def take_dirty(self, pages: PageArray, *, owner: int = ANYONE) -> PageArray:
        """Of ``pages`` (just allocated by the caller for ``owner``), those whose bytes may
        still be someone else's (freed since they were last zeroed, by another owner than
        ``owner`` or by :data:`ANYONE`), now counted as clean: the caller zeroes them, or
        overwrites them whole, before anyone else can read them. A page its own owner freed
        holds nothing that owner could not read: it comes back as it was, unzeroed (a worker
        that frees and re-allocates its own pages pays no memset)."""
        with self._lock:
            writers = self._writer[pages]
            dirty: PageArray = pages[(writers != CLEAN) & (writers != owner if owner > CLEAN else True)]
            self._writer[pages] = CLEAN
            return dirty

    def mark_all_dirty(self) -> None:
        """Every page's bytes are unknown (a segment re-mapped at a warm restart)."""
        with self._lock:
            self._writer[:] = ANYONE

    def check_free(self, pages: PagesLike) -> None:
        """Raise exactly what :meth:`free` would raise for ``pages``, without freeing."""
        arr = as_page_array(pages)
        with self._lock:
            self._check(arr, want_allocated=True)

    def free_tokens(self, token_indices: PagesLike) -> int:
        """Reference-compatible free of page-aligned token slots; returns pages freed."""
        return self.free(tokens_to_pages(token_indices, self.page_size))

    def mark_allocated(self, pages: PagesLike) -> None:
        """Take specific pages out of the free set (journal replay after a warm restart).

        FailedPrecondition if any is already allocated; nothing changes then.
        Costs O(capacity).
        """
        arr = as_page_array(pages)
        with self._lock:
            self._check(arr, want_allocated=False)
            if arr.size == 0:
                return
            self._allocated[arr] = True
            free = self._stack[: self._top]
            keep = free[~self._allocated[free]]
            self._top = keep.size
            self._stack[: self._top] = keep

    def is_allocated(self, pages: PagesLike) -> npt.NDArray[np.bool_]:
        arr = as_page_array(pages)
        with self._lock:
            self._check_range(arr)
            return self._allocated[arr].copy()

    def allocated_pages(self) -> PageArray:
        """All allocated pages, ascending (a copy; O(capacity))."""
        with self._lock:
            return np.flatnonzero(self._allocated).astype(np.int64)

    def _check_range(self, arr: PageArray) -> None:
        if arr.size == 0:
            return
        if arr.size <= SMALL_BATCH:
            listed = arr.tolist()
            if min(listed) >= 0 and max(listed) < self.capacity:
                return
        bad = arr[(arr < 0) | (arr >= self.capacity)]
        if bad.size:
            raise OutOfRange(f"page {int(bad[0])} is out of range [0, {self.capacity})")

    def _check(self, arr: PageArray, *, want_allocated: bool) -> PageArray:
        """Validate a whole request; return it sorted ascending."""
        self._check_range(arr)
        ordered = np.sort(arr)  # returned, and the repeat check reuses it
        repeated = first_repeat(arr, ordered)
        if repeated is not None:
            raise InvalidArgument(f"page {repeated} is listed more than once")
        wrong = arr[self._allocated[arr] != want_allocated]
        if wrong.size:
            if want_allocated:
                raise DoubleFree(f"page {int(wrong[0])} is not allocated (double free?)")
            raise FailedPrecondition(f"page {int(wrong[0])} is already allocated (double alloc)")
        return ordered

    def __repr__(self) -> str:
        return f"PageAllocator(capacity={self.capacity}, available={self._top})"


def pages_to_tokens(pages: PageArray, page_size: int) -> PageArray:
    """Token slot indices of whole pages, in page order."""
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)


def tokens_to_pages(token_indices: PagesLike, page_size: int) -> PageArray:
    """Pages of page-aligned token runs; InvalidArgument naming the first misaligned slot."""
    tok = as_page_array(token_indices, "token indices")
    if tok.size % page_size:
        raise InvalidArgument(f"{tok.size} token indices are not a multiple of the page size {page_size}")
    runs = tok.reshape(-1, page_size)
    expected = runs[:, :1] + np.arange(page_size, dtype=np.int64)
    bad = np.flatnonzero((runs[:, 0] % page_size != 0) | (runs != expected).any(axis=1))
    if bad.size:
        row = runs[bad[0]]
        raise InvalidArgument(
            f"token slots starting at {int(row[0])} are not one page-aligned run of {page_size}"
        )
    return runs[:, 0] // page_size
