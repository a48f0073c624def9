"""The content index's entries and input checks (internal to :mod:`hicached.index`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TypeVar

from hicached.errors import FailedPrecondition, InvalidArgument, NotFound, clip
from hicached.index.pools import GroupView
from hicached.l2.allocator import PageArray, as_page_array, first_repeat

__all__ = ["SELECTIVE_HITS", "Entry", "EntryRecord", "batches", "check_keys", "check_records", "check_rows"]

SELECTIVE_HITS = 2  # write_through_selective backs a page up on its second hit


@dataclasses.dataclass(eq=False, slots=True)
class Entry:
    """One cached key: its pages and who holds them. Guarded by the :class:`EntryTable` lock."""

    key: str
    pages: tuple[int, ...]  # one page per independent pool (GroupView.alloc_names order)
    tenant: str
    refs: int = 0  # pins plus in-flight backups; > 0 means never evict or free
    pins: int = 0
    hits: int = 0
    in_l3: bool = False
    backup_queued: bool = False
    detached: bool = False  # no longer findable; pages freed when refs drops to 0
    cleared: bool = False  # detached by clear(): do not write it to L3 any more
    freed: bool = False


@dataclasses.dataclass(frozen=True)
class EntryRecord:
    """A cached key as a warm-restart journal keeps it: no pins, refs or queued work.

    Immutable; ``pages`` maps every independent pool of the group to the key's
    one page there (the record owns nothing: the index that restores it takes
    the pages).
    """

    key: str
    pages: Mapping[str, int]
    tenant: str = ""
    in_l3: bool = False


def check_records(view: GroupView, records: Sequence[EntryRecord]) -> list[PageArray]:
    """One page column per independent pool of ``view`` for ``records``; raises before any change.

    InvalidArgument for a bad or repeated key, a non-str tenant, a record whose pools differ
    from the group's, a page out of range or listed twice; FailedPrecondition for a page
    that is already allocated.
    """
    check_keys([r.key for r in records], unique=True)
    names = view.alloc_names
    for r in records:
        if not isinstance(r.tenant, str) or not isinstance(r.in_l3, bool):
            raise InvalidArgument(f"record of key {r.key!r}: tenant must be a str and in_l3 a bool")
        if sorted(r.pages) != sorted(names):
            raise InvalidArgument(
                f"record of key {r.key!r} has pages of pools {sorted(r.pages)}; the group's are {sorted(names)}"
            )
    columns = []
    for name, allocator in zip(names, view.allocators, strict=True):
        arr = as_page_array([r.pages[name] for r in records], f"journaled pages of pool {name!r}")
        if arr.size:
            bad = arr[(arr < 0) | (arr >= allocator.capacity)]
            if bad.size:
                raise InvalidArgument(
                    f"journaled page {int(bad[0])} of pool {name!r} is outside [0, {allocator.capacity})"
                )
            if first_repeat(arr) is not None:
                raise InvalidArgument(f"pool {name!r}: a journaled page is listed twice")
            taken = arr[allocator.is_allocated(arr)]
            if taken.size:
                raise FailedPrecondition(
                    f"journaled page {int(taken[0])} of pool {name!r} is already allocated"
                )
        columns.append(arr)
    return columns


def check_keys(keys: Sequence[str], *, unique: bool = False) -> list[str]:
    """Keys as a list; InvalidArgument naming the first bad (or, with ``unique``, repeated) one."""
    if isinstance(keys, str):
        raise InvalidArgument(f"keys must be a sequence of str, got the single str {keys!r}")
    out = list(keys)
    try:  # all at once first (a keyed call checks its keys twice or more); one by one to name it
        suspect = "/" in "".join(out) or not all(out)
    except TypeError:  # not all str
        suspect = True
    for key in out if suspect else ():
        if not isinstance(key, str) or not key or "/" in key:
            got = clip(key) if isinstance(key, str) else repr(key)  # a non-str: a caller's bug
            raise InvalidArgument(f"content key must be a non-empty str without '/', got {got}")
    if unique and len(set(out)) != len(out):
        seen: set[str] = set()
        for key in out:
            if key in seen:
                raise InvalidArgument(f"content key {clip(key)} is listed more than once")
            seen.add(key)
    return out


T = TypeVar("T")


def batches(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def check_rows(view: GroupView, n: int, pages: Mapping[str, object]) -> list[PageArray]:
    """One validated page column per independent pool of ``view``; raises before any change."""
    names = view.alloc_names
    unknown = sorted(set(pages) - set(names))
    if unknown:
        raise NotFound(f"pool(s) {unknown} are not independent pools of this group (expected {names})")
    missing = [name for name in names if name not in pages]
    if missing:
        raise InvalidArgument(f"pages for pool(s) {missing} are missing (expected {list(names)})")
    columns = []
    for name, allocator in zip(names, view.allocators, strict=True):
        arr = as_page_array(pages[name], f"pages of pool {clip(name)}")
        if arr.size != n:
            raise InvalidArgument(f"pool {clip(name)} has {arr.size} pages for {n} keys")
        if arr.size:
            bad = arr[(arr < 0) | (arr >= allocator.capacity)]
            if bad.size:
                raise InvalidArgument(
                    f"page {int(bad[0])} of pool {clip(name)} is outside [0, {allocator.capacity})"
                )
            if first_repeat(arr) is not None:
                raise InvalidArgument(f"pool {clip(name)}: a page is listed twice in {arr.tolist()}")
            unallocated = arr[~allocator.is_allocated(arr)]
            if unallocated.size:
                raise FailedPrecondition(
                    f"page {int(unallocated[0])} of pool {clip(name)} is not allocated; publish "
                    f"only pages you allocated and wrote"
                )
        columns.append(arr)
    return columns
