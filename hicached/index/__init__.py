"""The content index: key -> L2 pages, L3 prefetch and backup, content-key hashing (:mod:`.keys`).

Pure Python over :mod:`hicached.l2` and :mod:`hicached.l3`; nothing here
knows about gRPC. The server builds one :class:`ContentIndex` per host pool
group.
"""

from hicached.index.index import ContentIndex
from hicached.index.jobs import PrefetchTask
from hicached.index.observer import IndexObserver, NullIndexObserver
from hicached.index.types import (
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
    "ContentIndex",
    "IndexObserver",
    "IndexStats",
    "LookupResult",
    "NullIndexObserver",
    "Pin",
    "PrefetchPolicy",
    "PrefetchState",
    "PrefetchStatus",
    "PrefetchTask",
    "WritePolicy",
    "prefetch_deadline_s",
]
