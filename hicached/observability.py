"""Every observation seam's Prometheus adapter, in one place.

Each layer declares what it reports as a Protocol beside its code, no-op by default:
:class:`~hicached.core.observer.CoreObserver` (sessions, copies),
:class:`~hicached.index.observer.IndexObserver` (lookups, evictions, backups, prefetches) and
:class:`~hicached.server.observer.RpcObserver` (one finished RPC). The adapters below turn those
events into the daemon's :class:`~hicached.metrics.Metrics`; :class:`HostGauges` reads the pool
groups' levels for the gauges. The composition root (``daemon.py``) wires them; no layer imports
this module, so every layer works, and is tested, without Prometheus.

Thread-safety: adapters only touch prometheus_client metric objects (thread-safe); their only
state of their own is the label children they looked up once (filled idempotently, see each
class), except :class:`HostGauges`, whose ``refresh`` is called from one thread (the event loop's
supervised ``gauges`` task).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from hicached.metrics import label_value
from hicached.transfer.plan import CopyPlan, Direction

if TYPE_CHECKING:
    from collections.abc import Callable

    import grpc
    from prometheus_client import Counter, Histogram

    from hicached.core.groups import GroupRegistry
    from hicached.core.sessions import Session
    from hicached.l3.stats_cache import StatsCache
    from hicached.metrics import Metrics
    from hicached.transfer.engine import CopyEngine

__all__ = ["CoreMetrics", "HostGauges", "IndexMetrics", "RpcMetrics"]


class CoreMetrics:
    """:class:`~hicached.core.observer.CoreObserver` feeding sessions and transfer metrics.

    Thread-safety: called from every copying thread at once; two first copies of one
    (direction, model, pool) may both look up its children, which are the same objects.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        # (direction, model, pool) -> its (tokens, bytes) children and their label values
        # (:func:`~hicached.metrics.label_value`): ``labels()`` cost more than the increments
        # (15 us a copy in all). As many as the registry holds for these series.
        self._children: dict[tuple[Direction, str, str], tuple[Counter, Counter, tuple[str, str]]] = {}
        self._durations = {
            d: metrics.transfer_duration.labels(direction=metrics.direction(d.value)) for d in Direction
        }

    def on_session(self, event: str, session: Session) -> None:
        if event == "attach":
            self._m.sessions.inc()
        else:
            self._m.sessions.dec()

    def on_copy(self, direction: Direction, plan: CopyPlan, seconds: float, model: str = "") -> None:
        for pool, n in plan.tokens_by_pool.items():
            self._pool_children(direction, model, pool)[0].inc(n)
        for pool, n in plan.bytes_by_pool.items():
            self._pool_children(direction, model, pool)[1].inc(n)
        self._durations[direction].observe(seconds)

    def retain(self, live: set[tuple[str, str]]) -> None:
        """Remove the write/load series of every (model, pool) label pair not in ``live``
        (their group was retired): model and pool names are the clients', and must not pile up
        in every scrape. A model that comes back starts its counters again from 0 (a counter
        reset). Called by :class:`HostGauges` on its one thread; a retired group has no
        session left to copy."""
        m = self._m
        for key, (_, _, labels) in list(self._children.items()):
            if labels in live:
                continue
            self._children.pop(key, None)
            pair = (
                (m.write_tokens, m.write_bytes) if key[0] is Direction.D2H else (m.load_tokens, m.load_bytes)
            )
            for counter in pair:
                with contextlib.suppress(KeyError):
                    counter.remove(*labels)

    def _pool_children(self, direction: Direction, model: str, pool: str) -> tuple[Counter, Counter]:
        """The (tokens, bytes) counters of one (direction, model, pool); groups sharing a
        model and pool name (other layouts) count into the same ones."""
        children = self._children.get((direction, model, pool))
        if children is None:
            tokens, nbytes = (
                (self._m.write_tokens, self._m.write_bytes)
                if direction is Direction.D2H
                else (self._m.load_tokens, self._m.load_bytes)
            )
            labels = (label_value(model), label_value(pool))
            children = self._children[(direction, model, pool)] = (
                tokens.labels(*labels),
                nbytes.labels(*labels),
                labels,
            )
        return children[0], children[1]


class IndexMetrics:
    """:class:`~hicached.index.observer.IndexObserver` of one pool group's content index;
    ``backend`` labels the L3 series, ``page_size`` turns pages into tokens."""

    def __init__(self, metrics: Metrics, *, backend: str, page_size: int) -> None:
        self._m = metrics
        self._backend = backend
        self._page_size = page_size
        # Every Lookup counts both tiers: their children once (``labels()`` per call was most
        # of the 9 us of this method).
        self._l2_hits = metrics.lookup_hit_pages.labels(tier="l2")
        self._l3_hits = metrics.lookup_hit_pages.labels(tier="l3")
        self._l3_to_l2 = metrics.transfer_duration.labels(direction="l3_to_l2")
        self._l2_to_l3 = metrics.transfer_duration.labels(direction="l2_to_l3")

    def lookup(self, query_pages: int, l2_hit_pages: int, l3_hit_pages: int) -> None:
        self._m.lookup_query_pages.inc(query_pages)
        self._l2_hits.inc(l2_hit_pages)
        self._l3_hits.inc(l3_hit_pages)

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
        self._l3_to_l2.observe(seconds)
        if seconds > 0:
            self._m.prefetch_bandwidth.labels(backend=b).observe(nbytes / seconds / 1e9)

    def backed_up(self, pages: int, nbytes: int, seconds: float) -> None:
        b = self._backend
        self._m.backup_pages.labels(backend=b).inc(pages)
        self._m.backup_bytes.labels(backend=b).inc(nbytes)
        self._m.backuped_tokens.labels(backend=b).inc(pages * self._page_size)
        self._m.backup_batch_pages.labels(backend=b).observe(pages)
        self._m.backup_duration.labels(backend=b).observe(seconds)
        self._l2_to_l3.observe(seconds)
        if seconds > 0:
            self._m.backup_bandwidth.labels(backend=b).observe(nbytes / seconds / 1e9)


class RpcMetrics:
    """:class:`~hicached.server.observer.RpcObserver` counting RPCs by method and code.

    Thread-safety: called from the event loop and from fast-lane threads at once; two first
    calls of one (method, code) may both look up its children, which are the same objects.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        # (method, code) -> its children: ``labels()`` costs more than the observation itself,
        # and it runs once per RPC. Bounded: methods and codes are fixed sets.
        self._children: dict[tuple[str, grpc.StatusCode], tuple[Counter, Histogram]] = {}

    def on_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        children = self._children.get((method, code))
        if children is None:
            children = self._children[(method, code)] = (
                self._m.rpcs.labels(method=method, code=code.name),
                self._m.rpc_duration.labels(method=method),
            )
        children[0].inc()
        children[1].observe(seconds)


class HostGauges:
    """Host pool usage, copy-queue depths, retraction backups held and the L3 backend's read
    counters, read from the live objects on each ``refresh``.

    Series are per (model, pool) label pair: pool groups of one model in other layouts (the
    same pool names, another head_dim or page size) are summed into it, as its write/load
    counters are (each group set the gauge in turn before, and the last one won). A retired
    pool group's series are removed with it (its write/load counters too, through ``core``),
    so a scrape never shows a group that is gone. The L3 counters move by what the backend
    counted since the last refresh, as the stats cache last read them (no I/O here: a hung
    backend holds neither this nor a scrape). Not thread-safe: one caller (the event loop's
    supervised ``gauges`` task) refreshes.
    """

    def __init__(
        self,
        metrics: Metrics,
        groups: GroupRegistry,
        engine: CopyEngine,
        core: CoreMetrics | None = None,
        *,
        backups: Callable[[], int] | None = None,
        l3_stats: StatsCache | None = None,
    ) -> None:
        self._m = metrics
        self._groups = groups
        self._engine = engine
        self._core = core  # its write/load series of retired groups go too
        self._backups = backups
        self._l3_stats = l3_stats
        self._l3_seen = (0, 0, 0)  # hits, misses, corrupt pages already counted
        self._labels: set[tuple[str, str]] = set()

    def refresh(self) -> None:
        m = self._m
        # (model, pool) label pair -> used tokens, total tokens, used bytes, total bytes
        sums: dict[tuple[str, str], list[int]] = {}
        for state in self._groups.all():
            model = label_value(state.model_name)
            for p in state.states():
                used = p.total_pages - p.free_pages
                levels = sums.setdefault((model, label_value(p.name)), [0, 0, 0, 0])
                levels[0] += used * p.page_size
                levels[1] += p.total_pages * p.page_size
                levels[2] += used * p.page_bytes
                levels[3] += p.total_pages * p.page_bytes
        gauges = (m.host_used_tokens, m.host_total_tokens, m.host_used_bytes, m.host_total_bytes)
        for labels, levels in sums.items():
            for gauge, level in zip(gauges, levels, strict=True):
                gauge.labels(*labels).set(level)
        seen = set(sums)
        for model, pool in self._labels - seen:
            for gauge in gauges:
                with contextlib.suppress(KeyError):
                    gauge.remove(model, pool)
        self._labels = seen
        if self._core is not None:
            self._core.retain(seen)
        for priority, depth in self._engine.queue_depth().items():
            m.queue_depth.labels(priority=m.priority(priority)).set(depth)
        if self._backups is not None:
            m.retraction_backups.set(self._backups())
        if self._l3_stats is not None:
            self._count_l3_reads(self._l3_stats)

    def _count_l3_reads(self, cache: StatsCache) -> None:
        got = cache.get()
        if got.stats is None:
            return
        now = (got.stats.hits, got.stats.misses, got.stats.corrupt_pages)
        counters = (self._m.l3_hits, self._m.l3_misses, self._m.l3_corrupt_pages)
        for counter, value, seen in zip(counters, now, self._l3_seen, strict=True):
            # Each child exists from the first stats on (a zero is a sample, not an absence).
            counter.labels(backend=got.name).inc(max(value - seen, 0))
        self._l3_seen = now
