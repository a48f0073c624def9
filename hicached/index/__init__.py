"""The content index: key -> L2 pages, L3 prefetch and backup.

Pure Python over :mod:`hicached.l2` and :mod:`hicached.l3`; nothing here
knows about gRPC. The daemon (``hicached.daemon.attach_content_index``) builds
one :class:`ContentIndex` per host pool group; the index registers itself as
that group's :class:`~hicached.l2.group.Reclaimer`. Rooms: ``index.py`` (the
facade), ``table.py`` (entries and their lock), ``writer.py`` and ``backup.py``
(L2 -> L3), ``prefetch.py`` (L3 -> L2), ``jobs.py`` (I/O threads).
"""

from hicached.index.index import ContentIndex
from hicached.index.jobs import PrefetchTask
from hicached.index.observer import IndexObserver, NullIndexObserver
from hicached.index.types import (
    DEFAULT_BATCH_PAGES,
    BackupResult,
    IndexOptions,
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
    "IndexOptions",
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
