"""The daemon's content-addressed cache: key -> L2 page index, L3 prefetch and backup.

Pure Python over :mod:`hicached.l2` and :mod:`hicached.l3`; nothing here
knows about gRPC. The server builds one :class:`ContentIndex` per host pool
group.
"""

from hicached.cache.index import ContentIndex
from hicached.cache.jobs import PrefetchTask
from hicached.cache.observer import CacheObserver, MetricsObserver
from hicached.cache.types import (
    DEFAULT_BATCH_PAGES,
    BackupResult,
    IndexStats,
    LookupResult,
    Pin,
    PrefetchPolicy,
    PrefetchState,
    PrefetchStatus,
    WritePolicy,
    prefetch_deadline_s,
)

__all__ = [
    "DEFAULT_BATCH_PAGES",
    "BackupResult",
    "CacheObserver",
    "ContentIndex",
    "IndexStats",
    "LookupResult",
    "MetricsObserver",
    "Pin",
    "PrefetchPolicy",
    "PrefetchState",
    "PrefetchStatus",
    "PrefetchTask",
    "WritePolicy",
    "prefetch_deadline_s",
]
