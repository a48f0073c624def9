"""The content index's observation seam: :class:`IndexObserver`, no-op by default.

Thread-safety: hooks are called from the caller's thread and from the index's I/O threads,
never while the index holds its lock; an observer must be thread-safe (prometheus_client
metrics are), must not block and must not raise. The Prometheus adapter is
:class:`hicached.observability.IndexMetrics`.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["IndexObserver", "NullIndexObserver"]


class IndexObserver(Protocol):
    """What the content index reports: lookups, evictions, drops, prefetches and backups."""

    def lookup(self, query_pages: int, l2_hit_pages: int, l3_hit_pages: int) -> None:
        """A lookup of ``query_pages`` keys found a leading run in L2, then more in L3."""

    def evicted(self, tier: str, reason: str, pages: int) -> None:
        """``pages`` left ``tier`` (``"l2"``/``"l3"``) for ``reason`` (``"lru"``, ``"clear"``)."""

    def dropped(self, reason: str, pages: int) -> None:
        """Pages that were to be backed up were not (``"backpressure"``, ``"backup_failed"``)."""

    def prefetched(self, pages: int, nbytes: int, seconds: float) -> None:
        """One prefetch batch (L3 -> L2) landed."""

    def backed_up(self, pages: int, nbytes: int, seconds: float) -> None:
        """One backup batch (L2 -> L3) was acknowledged by the backend."""


class NullIndexObserver:
    """The default: observes nothing."""

    def lookup(self, query_pages: int, l2_hit_pages: int, l3_hit_pages: int) -> None:
        pass

    def evicted(self, tier: str, reason: str, pages: int) -> None:
        pass

    def dropped(self, reason: str, pages: int) -> None:
        pass

    def prefetched(self, pages: int, nbytes: int, seconds: float) -> None:
        pass

    def backed_up(self, pages: int, nbytes: int, seconds: float) -> None:
        pass
