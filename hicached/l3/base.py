"""The L3 storage backend interface.

A backend maps opaque string keys to page bytes. Keys arrive already
namespaced by the caller (model, TP rank, layout, pool, tenant, content
hash), so a backend never parses them. Every method works on a batch and
reports per-key results; a miss, a corrupt page or a full store is a result,
never an exception. Exceptions are reserved for bad input
(:class:`~hicached.errors.InvalidArgument`) and an unusable backend
(:class:`~hicached.errors.Unavailable`).

Buffers: values passed to ``set``/``set_from`` are borrowed for the duration
of the call and never retained. Destination chunks passed to ``get_into`` are
owned by the caller (normally host-pool page memory); a backend writes into
them only during the call, and on a ``False`` result their content is
unspecified (the caller treats the page as a miss).
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from hicached.errors import InvalidArgument

__all__ = ["BackendStats", "ReadCounters", "ReadCounts", "StorageBackend", "check_batch", "chunks_nbytes"]


@dataclasses.dataclass(frozen=True)
class BackendStats:
    """A point-in-time snapshot of a backend's counters.

    ``pages``/``bytes`` describe what is stored now (payload bytes);
    ``capacity_bytes`` is 0 when the backend has no limit it can report.
    ``hits``/``misses`` count pages asked for by ``get``/``get_into``;
    ``corrupt_pages`` counts pages that failed verification (also counted as
    misses); ``evicted_pages`` counts pages dropped to make room.
    """

    pages: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    corrupt_pages: int
    evicted_pages: int


@dataclasses.dataclass(frozen=True)
class ReadCounts:
    """A snapshot of :class:`ReadCounters` (the ``hits``/``misses``/``corrupt_pages`` of
    :class:`BackendStats`)."""

    hits: int
    misses: int
    corrupt_pages: int


class ReadCounters:
    """A backend's read counters: pages hit and missed by ``get``/``get_into``, pages
    that failed verification (a corrupt page is also counted as a miss, by ``count``).

    Thread-safe: its own lock, a leaf (held only for the arithmetic), so a backend may
    call it from any thread, with or without its own locks held.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits = self._misses = self._corrupt = 0

    def count(self, ok: Sequence[bool]) -> None:
        """One read's results: a hit per true flag, a miss per false one."""
        hits = sum(ok)
        with self._lock:
            self._hits += hits
            self._misses += len(ok) - hits

    def corrupt(self, n: int = 1) -> None:
        with self._lock:
            self._corrupt += n

    def snapshot(self) -> ReadCounts:
        with self._lock:
            return ReadCounts(self._hits, self._misses, self._corrupt)


def chunks_nbytes(chunks: Sequence[memoryview]) -> int:
    return sum(c.nbytes for c in chunks)


def scatter_into(page: bytes | memoryview | None, chunks: Sequence[memoryview]) -> bool:
    """Copy ``page`` across the writable ``chunks`` (their concatenation); False, and
    nothing written, for a miss or a length that differs from the destination's."""
    if page is None or len(page) != chunks_nbytes(chunks):
        return False
    offset = 0
    for chunk in chunks:
        view = chunk.cast("B") if chunk.format != "B" or chunk.ndim != 1 else chunk
        view[:] = page[offset : offset + view.nbytes]
        offset += view.nbytes
    return True


def check_batch(keys: Sequence[str], values: Sequence[object], what: str) -> None:
    """Reject a batch whose keys and values do not pair up, naming the lengths."""
    if len(keys) != len(values):
        raise InvalidArgument(f"{len(keys)} keys but {len(values)} {what}")
    for key in keys:
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"storage key must be a non-empty str, got {key!r}")


class StorageBackend(ABC):
    """Stores opaque string keys -> page bytes (L3).

    Contract shared by every implementation (the conformance suite in
    ``tests/l3`` checks it against each):

    * ``exists`` returns the length of the leading run of keys that are
      present (prefix semantics: pages are looked up in prefix order);
      ``present`` answers for every key, also after a miss.
    * ``set`` of a key that is already present succeeds without rewriting it
      (content-addressed keys: same key, same bytes). ``True`` means the page
      survives a crash of this process (and of the machine when the backend
      says so, e.g. the file backend with ``fsync``).
    * A page is served only after its checksum verified; a corrupt page is a
      miss and is counted in ``corrupt_pages``. Readers never see a partial
      page.
    * Thread-safety: every implementation in this package may be called from
      several threads at once; each states how it achieves that.

    The default ``get_into``/``set_from`` copy through ``get``/``set``;
    backends that can move bytes straight between the caller's chunks and the
    store override them.
    """

    name: ClassVar[str]
    # Longest key (its :meth:`name_bytes`) the backend can store; None = no limit it knows of.
    # Callers refuse longer keys up front, so a key is never accepted and then failed in the
    # I/O thread.
    max_key_bytes: ClassVar[int | None] = None

    def name_bytes(self, key: str) -> int:
        """Bytes of ``key``'s name in the store, which :attr:`max_key_bytes` bounds (UTF-8,
        unless the backend rewrites keys). Pure: thread-safe."""
        return len(key.encode("utf-8"))

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are present."""

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Per key: present. The default asks :meth:`exists` once per key; backends that
        can ask for many keys in one request override it."""
        return [self.exists([key]) == 1 for key in keys]

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The page of each key, or ``None`` for a miss (including a corrupt page)."""

    @abstractmethod
    def set(self, keys: Sequence[str], values: Sequence[bytes | memoryview]) -> list[bool]:
        """Store each page; per-key success. Values are borrowed for the call only."""

    def get_into(self, keys: Sequence[str], dests: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Read page ``i`` into the writable chunks ``dests[i]`` (their concatenation).

        ``False`` for a miss, a corrupt page, or a stored page whose length
        differs from the destination's.
        """
        check_batch(keys, dests, "destinations")
        return [scatter_into(page, chunks) for page, chunks in zip(self.get(keys), dests, strict=True)]

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Store page ``i`` from the concatenation of the chunks ``srcs[i]``."""
        check_batch(keys, srcs, "sources")
        values: list[bytes | memoryview] = [
            chunks[0] if len(chunks) == 1 else b"".join(chunks) for chunks in srcs
        ]
        return self.set(keys, values)

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> int:
        """Remove the keys; returns how many were present."""

    @abstractmethod
    def clear(self, prefix: str = "") -> int:
        """Remove every key that starts with ``prefix``; returns how many."""

    @abstractmethod
    def stats(self) -> BackendStats:
        """A snapshot of the counters (see :class:`BackendStats`)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files, sockets and threads. Idempotent."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
