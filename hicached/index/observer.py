"""Hooks through which the content index reports what it does.

:class:`CacheObserver` has a no-op body for every hook, so the index works
without metrics and a test can override one hook. :class:`MetricsObserver`
feeds the daemon's Prometheus :class:`~hicached.metrics.Metrics`; it only
touches the metric objects it is given, so this module needs no import of
the metrics layer at run time.

Thread-safety: hooks are called from the caller's thread and from the
index's I/O threads, never while the index holds its lock; an observer must
be thread-safe (prometheus_client metrics are).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicached.metrics import Metrics

__all__ = ["CacheObserver", "MetricsObserver"]


class CacheObserver:
    """No-op hooks; subclass and override the ones you need."""

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


class MetricsObserver(CacheObserver):
    """Feeds the daemon's Prometheus metrics; ``backend`` labels the L3 series."""

    def __init__(self, metrics: Metrics, *, backend: str, page_size: int) -> None:
        self._m = metrics
        self._backend = backend
        self._page_size = page_size

    def lookup(self, query_pages: int, l2_hit_pages: int, l3_hit_pages: int) -> None:
        self._m.lookup_query_pages.inc(query_pages)
        self._m.lookup_hit_pages.labels(tier="l2").inc(l2_hit_pages)
        self._m.lookup_hit_pages.labels(tier="l3").inc(l3_hit_pages)

    def evicted(self, tier: str, reason: str, pages: int) -> None:
        self._m.evicted_tokens.labels(tier=self._m.tier(tier), reason=reason).inc(pages * self._page_size)

    def dropped(self, reason: str, pages: int) -> None:
        self._m.dropped_tokens.labels(reason=reason).inc(pages * self._page_size)

    def prefetched(self, pages: int, nbytes: int, seconds: float) -> None:
        b = self._backend
        self._m.prefetch_pages.labels(backend=b).inc(pages)
        self._m.prefetch_bytes.labels(backend=b).inc(nbytes)
        self._m.prefetched_tokens.labels(backend=b).inc(pages * self._page_size)
        self._m.prefetch_batch_pages.labels(backend=b).observe(pages)
        self._m.prefetch_duration.labels(backend=b).observe(seconds)
        if seconds > 0:
            self._m.prefetch_bandwidth.labels(backend=b).observe(nbytes / seconds / 1e9)

    def backed_up(self, pages: int, nbytes: int, seconds: float) -> None:
        b = self._backend
        self._m.backup_pages.labels(backend=b).inc(pages)
        self._m.backup_bytes.labels(backend=b).inc(nbytes)
        self._m.backuped_tokens.labels(backend=b).inc(pages * self._page_size)
        self._m.backup_batch_pages.labels(backend=b).observe(pages)
        self._m.backup_duration.labels(backend=b).observe(seconds)
        if seconds > 0:
            self._m.backup_bandwidth.labels(backend=b).observe(nbytes / seconds / 1e9)
