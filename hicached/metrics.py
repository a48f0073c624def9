"""Prometheus metrics of the daemon and the HTTP endpoint that exposes them.

Every metric is named ``hicached_*`` and modelled on SGLang HiCache's own
(``hicache_host_used_tokens``, ``load_back_tokens_total``, ``prefetch_pgs``,
``backup_bandwidth``...), so that dashboards written for in-process HiCache
translate directly. docs/metrics.md is the reference for operators.

Cardinality is bounded by construction: ``model`` and ``pool`` are the live pool
groups' (at most ``host.max_groups`` groups of ``limits.max_pools_per_attach`` pools; a
retired group's series are removed, and groups sharing a model and pool name share its
series, summed: hicached/observability.py), each value at most :data:`MAX_LABEL_CHARS`
characters (:func:`label_value`); ``backend``, ``method`` and ``reason`` come from the
code, and ``tier``, ``direction``, ``priority`` and ``code`` are closed
vocabularies, checked here.
Never label a metric with a session, request, operation or page id: those
belong in logs.

Thread-safety: prometheus_client metric objects are thread-safe; a
:class:`Metrics` may be shared by every thread and the asyncio loop. Each
:class:`Metrics` owns its own ``CollectorRegistry`` (never the process-global
default one), so tests and embedded daemons can build several side by side.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hicached import metrics_http
from hicached.errors import InvalidArgument
from hicached.metrics_http import MetricsServer
from hicached.transfer.engine import Priority

__all__ = [
    "BANDWIDTH_BUCKETS_GBPS",
    "DIRECTIONS",
    "DURATION_BUCKETS",
    "MAX_LABEL_CHARS",
    "PREFIX",
    "PRIORITIES",
    "RPC_CODES",
    "TASKS",
    "TIERS",
    "Metrics",
    "MetricsServer",
    "label_value",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

PREFIX = "hicached"

# Closed label vocabularies. Children for these values are created up front so
# that every series exists (at zero) from the first scrape: rate() and the
# dashboard's ratios then work before the first event.
TIERS = ("l2", "l3")
DIRECTIONS = ("d2h", "h2d", "l3_to_l2", "l2_to_l3")
# The copy engine's own priority classes, spelled in lower case: the producer and the
# metric share one vocabulary (``Priority.WRITE_BACK`` -> ``write_back``).
PRIORITIES = tuple(p.name.lower() for p in Priority)
# Periodic background tasks of the daemon (bounded: names are code constants).
TASKS = ("gauges", "l3_stats", "handoff_sweep", "lane_accept", "lease_reaper", "metrics_http")
# gRPC status code names (grpc.StatusCode.X.name); spelled out here because
# only hicached.server may import grpc.
RPC_CODES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)

# 10 µs (a small pinned copy) .. 10 s (a cold S3 batch), roughly x2.5 per step.
DURATION_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# GB/s per batch, as the reference's prefetch/backup bandwidth histograms;
# extended upwards because host<->device copies reach ~55 GB/s on PCIe Gen5.
BANDWIDTH_BUCKETS_GBPS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
# Pages per prefetch/backup batch (the reference batches by 128 pages).
BATCH_PAGE_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024)


# Longest ``model``/``pool`` label value. Names are the clients' (up to limits.max_identity_bytes
# each): 64 models x 32 pools of 256- and 100-byte names made every scrape 3.3 MB (180x).
MAX_LABEL_CHARS = 64
_HASH_CHARS = 8


@functools.lru_cache(maxsize=4096)  # the gauges ask again every second for every live pool
def label_value(name: str) -> str:
    """``name`` as a ``model`` or ``pool`` label value: itself up to :data:`MAX_LABEL_CHARS`
    characters, else its first characters, ``~`` and 8 hex digits of its SHA-256, 64 in all
    (so that names sharing a long prefix stay distinct series)."""
    if len(name) <= MAX_LABEL_CHARS:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    return f"{name[: MAX_LABEL_CHARS - _HASH_CHARS - 1]}~{digest}"


def _check_vocabulary(label: str, value: str, allowed: Iterable[str]) -> str:
    allowed_values = tuple(allowed)
    if value not in allowed_values:
        raise InvalidArgument(f"metric label {label}={value!r} is not one of {allowed_values}")
    return value


class Metrics:
    """All of the daemon's metrics, in a registry of their own.

    Attributes are plain prometheus_client objects; callers do
    ``metrics.write_bytes.labels(model=m, pool=p).inc(n)`` or
    ``with metrics.transfer_duration.labels(direction="d2h").time(): ...``.
    For closed vocabularies use the checked helpers (:meth:`tier`,
    :meth:`direction`, :meth:`priority`, :meth:`code`), which raise
    :class:`~hicached.errors.InvalidArgument` on a value outside the set
    rather than silently minting a new series.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        p = PREFIX

        # --- L2: host pools (reference: hicache_host_used/total_tokens) ---
        pool = ("model", "pool")
        self.host_used_tokens = Gauge(f"{p}_host_used_tokens", "Host (L2) tokens in use.", pool, registry=r)
        self.host_total_tokens = Gauge(
            f"{p}_host_total_tokens", "Host (L2) token capacity.", pool, registry=r
        )
        self.host_used_bytes = Gauge(f"{p}_host_used_bytes", "Host (L2) bytes in use.", pool, registry=r)
        self.host_total_bytes = Gauge(f"{p}_host_total_bytes", "Host (L2) byte capacity.", pool, registry=r)

        # --- device <-> host transfers (reference: evicted/load_back tokens) ---
        self.write_tokens = Counter(
            f"{p}_write_tokens", "Tokens written device->host (D2H backup).", pool, registry=r
        )
        self.write_bytes = Counter(f"{p}_write_bytes", "Bytes written device->host (D2H).", pool, registry=r)
        self.load_tokens = Counter(
            f"{p}_load_tokens", "Tokens loaded host->device (H2D load-back).", pool, registry=r
        )
        self.load_bytes = Counter(f"{p}_load_bytes", "Bytes loaded host->device (H2D).", pool, registry=r)
        self.transfer_duration = Histogram(
            f"{p}_transfer_duration_seconds",
            "Duration of one transfer batch, from dequeue to completion.",
            ("direction",),
            buckets=DURATION_BUCKETS,
            registry=r,
        )

        # --- eviction and drops ---
        self.evicted_tokens = Counter(
            f"{p}_evicted_tokens", "Tokens evicted from a tier, by reason.", ("tier", "reason"), registry=r
        )
        self.dropped_tokens = Counter(
            f"{p}_dropped_tokens",
            "Tokens a request asked to store that were not stored (no room, backpressure, failed batch).",
            ("reason",),
            registry=r,
        )

        # --- L3: prefetch (L3->L2) and backup (L2->L3) per backend ---
        backend = ("backend",)
        self.prefetch_pages = Counter(f"{p}_prefetch_pages", "Pages prefetched L3->L2.", backend, registry=r)
        self.prefetch_bytes = Counter(f"{p}_prefetch_bytes", "Bytes prefetched L3->L2.", backend, registry=r)
        self.prefetched_tokens = Counter(
            f"{p}_prefetched_tokens", "Tokens prefetched L3->L2.", backend, registry=r
        )
        self.backup_pages = Counter(f"{p}_backup_pages", "Pages backed up L2->L3.", backend, registry=r)
        self.backup_bytes = Counter(f"{p}_backup_bytes", "Bytes backed up L2->L3.", backend, registry=r)
        self.backuped_tokens = Counter(
            f"{p}_backuped_tokens", "Tokens backed up L2->L3 (reference spelling).", backend, registry=r
        )
        self.prefetch_batch_pages = Histogram(
            f"{p}_prefetch_batch_pages",
            "Pages per prefetch batch.",
            backend,
            buckets=BATCH_PAGE_BUCKETS,
            registry=r,
        )
        self.backup_batch_pages = Histogram(
            f"{p}_backup_batch_pages",
            "Pages per backup batch.",
            backend,
            buckets=BATCH_PAGE_BUCKETS,
            registry=r,
        )
        self.prefetch_bandwidth = Histogram(
            f"{p}_prefetch_bandwidth_gbps",
            "Bandwidth of one prefetch batch in GB/s.",
            backend,
            buckets=BANDWIDTH_BUCKETS_GBPS,
            registry=r,
        )
        self.backup_bandwidth = Histogram(
            f"{p}_backup_bandwidth_gbps",
            "Bandwidth of one backup batch in GB/s.",
            backend,
            buckets=BANDWIDTH_BUCKETS_GBPS,
            registry=r,
        )
        self.prefetch_duration = Histogram(
            f"{p}_prefetch_duration_seconds",
            "Duration of one prefetch batch.",
            backend,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.backup_duration = Histogram(
            f"{p}_backup_duration_seconds",
            "Duration of one backup batch.",
            backend,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.l3_hits = Counter(f"{p}_l3_hits", "Pages found in an L3 backend.", backend, registry=r)
        self.l3_misses = Counter(
            f"{p}_l3_misses", "Pages looked up and not found in an L3 backend.", backend, registry=r
        )
        self.l3_corrupt_pages = Counter(
            f"{p}_l3_corrupt_pages",
            "Pages whose checksum or MAC failed on read (or not a page); each is served as a miss.",
            backend,
            registry=r,
        )

        # --- content lookups: per-tier hit rate = hit_pages{tier} / query_pages ---
        self.lookup_query_pages = Counter(
            f"{p}_lookup_query_pages", "Pages asked for by Lookup/Prefetch queries.", registry=r
        )
        self.lookup_hit_pages = Counter(
            f"{p}_lookup_hit_pages",
            "Queried pages found, by the tier that served them.",
            ("tier",),
            registry=r,
        )

        # --- control plane ---
        self.sessions = Gauge(f"{p}_sessions", "Attached worker sessions.", registry=r)
        self.rpcs = Counter(
            f"{p}_rpcs", "Completed RPCs by method and gRPC status code.", ("method", "code"), registry=r
        )
        self.rpc_duration = Histogram(
            f"{p}_rpc_duration_seconds",
            "Server-side RPC handling time.",
            ("method",),
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            f"{p}_queue_depth",
            "Copy operations waiting in the node-wide scheduler.",
            ("priority",),
            registry=r,
        )
        self.task_failures = Counter(
            f"{p}_background_task_failures",
            "Failures of a periodic background task (each is logged with its traceback and retried).",
            ("task",),
            registry=r,
        )
        self.retraction_backups = Gauge(
            f"{p}_retraction_backups", "Retracted requests whose backup is held on the host.", registry=r
        )

        for tier in TIERS:
            self.lookup_hit_pages.labels(tier=tier)
        for direction in DIRECTIONS:
            self.transfer_duration.labels(direction=direction)
        for priority in PRIORITIES:
            self.queue_depth.labels(priority=priority)
        for task in TASKS:
            self.task_failures.labels(task=task)

    # Checked accessors for the closed vocabularies.
    @staticmethod
    def tier(value: str) -> str:
        return _check_vocabulary("tier", value, TIERS)

    @staticmethod
    def direction(value: str) -> str:
        return _check_vocabulary("direction", value, DIRECTIONS)

    @staticmethod
    def priority(value: str | Priority) -> str:
        """The label of a copy priority (a :class:`Priority` or its lower-case name)."""
        if isinstance(value, Priority):
            value = value.name.lower()
        return _check_vocabulary("priority", value, PRIORITIES)

    @staticmethod
    def task(value: str) -> str:
        return _check_vocabulary("task", value, TASKS)

    @staticmethod
    def code(value: str) -> str:
        return _check_vocabulary("code", value, RPC_CODES)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry (what /metrics serves)."""
        return generate_latest(self.registry)

    def metric_names(self) -> frozenset[str]:
        """Every sample name this registry emits (``_total``, ``_bucket``, ``_created``...)."""
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
        names: set[str] = set()
        for family in self.registry.collect():
            names.update(f"{family.name}{suffix}" for suffix in suffixes.get(family.type, ("",)))
        return frozenset(names)


def serve_metrics(
    metrics: Metrics, host: str, port: int, *, on_failure: Callable[[], None] | None = None
) -> MetricsServer:
    """Serve ``metrics`` as Prometheus text on ``http://host:port/metrics``.

    ``port`` 0 picks a free port; the returned ``port`` is the real one. The server runs on a
    daemon thread of its own (scrapes never touch the asyncio loop), bounded in connections,
    time and bytes (:mod:`hicached.metrics_http`), until :meth:`MetricsServer.close`;
    ``on_failure`` is called on that thread when a step of it failed (logged, then it goes on).
    """
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"metrics port {port} is outside 0..65535")
    server = metrics_http.start(metrics.registry, host, port, on_failure=on_failure)
    logger.info("metrics on http://%s:%d/metrics", host, server.port)
    return server
