"""Value types of the content-addressed cache: policies, results and the deadline formula.

Pure data: no I/O, no threads, no imports from the pool or storage layers.
``PrefetchState`` is the wire vocabulary's (:mod:`hicached_client.vocab`).
Every result is a frozen dataclass, safe to hand to any thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
from hicached_client import vocab

from hicached.errors import InvalidArgument
from hicached.policies import PrefetchPolicy, WritePolicy

__all__ = [
    "DEFAULT_BATCH_PAGES",
    "BackupResult",
    "IndexOptions",
    "IndexStats",
    "LookupResult",
    "Pin",
    "PrefetchPolicy",
    "PrefetchState",
    "PrefetchStatus",
    "WritePolicy",
    "prefetch_deadline_s",
]

# The reference queries L3 and moves pages in batches of 128 pages.
DEFAULT_BATCH_PAGES = 128


# One type with the client's (the wire vocabulary): a task is never UNSPECIFIED.
PrefetchState = vocab.PrefetchState


@dataclasses.dataclass(frozen=True)
class PrefetchStatus:
    state: PrefetchState
    completed_pages: int
    planned_pages: int


@dataclasses.dataclass(frozen=True)
class LookupResult:
    """Leading runs of the queried keys: resident in L2; resident in L2 or L3."""

    l2_hit_pages: int
    total_hit_pages: int
    # Per key, for a per-key lookup only (empty otherwise): resident in L2; in L2 or L3.
    in_l2: tuple[bool, ...] = ()
    cached: tuple[bool, ...] = ()

    @classmethod
    def of_flags(cls, in_l2: Sequence[bool], cached: Sequence[bool]) -> LookupResult:
        """The result of a per-key lookup: its leading runs follow from the flags."""
        return cls(_leading(in_l2), _leading(cached), tuple(in_l2), tuple(cached))


def _leading(flags: Sequence[bool]) -> int:
    return next((i for i, hit in enumerate(flags) if not hit), len(flags))


@dataclasses.dataclass(frozen=True)
class Pin:
    """A ref-counted hold on the leading L2 run of some keys.

    ``pages`` maps every independently allocated pool of the group to one
    host page per key (derived pools reuse their source pool's indices). The
    pages stay owned by the index; the holder may read them until it passes
    the pin to :meth:`ContentIndex.unpin`, exactly once. ``id`` identifies
    the pin inside its index.
    """

    id: int
    keys: tuple[str, ...]
    pages: Mapping[str, npt.NDArray[np.int64]]

    def __len__(self) -> int:
        return len(self.keys)


@dataclasses.dataclass(frozen=True)
class BackupResult:
    """``queued``: pages handed to the L3 writer (cached in L2, not yet in L3).
    ``stored``: with ``wait``, pages acknowledged by L3 (0 without ``wait``).
    ``shortfall``: with ``wait``, why ``stored < queued``, for a person ("" otherwise)."""

    queued: int
    stored: int
    shortfall: str = ""


@dataclasses.dataclass(frozen=True)
class IndexStats:
    """A snapshot of one index's counters (totals since construction)."""

    entries: int
    pinned_entries: int
    l3_resident_entries: int
    queued_backup_pages: int
    running_prefetches: int
    published_pages: int
    evicted_pages: int
    backed_up_pages: int
    backup_failed_pages: int
    prefetched_pages: int
    dropped_backup_pages: int


def prefetch_deadline_s(num_tokens: int, base_s: float = 1.0, per_1k_tokens_s: float = 0.25) -> float:
    """The reference's prefetch timeout: ``base_s + per_1k_tokens_s * num_tokens / 1024``."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InvalidArgument(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if base_s < 0 or per_1k_tokens_s < 0:
        raise InvalidArgument(
            f"prefetch timeout parameters must be non-negative, got base_s={base_s!r}, "
            f"per_1k_tokens_s={per_1k_tokens_s!r}"
        )
    return base_s + per_1k_tokens_s * num_tokens / 1024.0


@dataclasses.dataclass(frozen=True)
class IndexOptions:
    """The tunables of one :class:`~hicached.index.index.ContentIndex` (the daemon sets the
    first four from ``[l3]``; the rest are for tests and benches).

    Validated at construction: :class:`~hicached.errors.InvalidArgument` for an option
    that cannot work. ``write_policy`` may be given as its name (a str); it is stored as a
    :class:`WritePolicy`. Frozen, so safe to share between threads and indexes.
    """

    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    io_workers: int = 2
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_1k_tokens_s: float = 0.25
    max_queued_pages: int = 65536
    batch_pages: int = DEFAULT_BATCH_PAGES
    max_finished_prefetches: int = 1024
    write_back_free_fraction: float = 0.125

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
        except ValueError:
            raise InvalidArgument(
                f"unknown write policy {self.write_policy!r}; use one of {[p.value for p in WritePolicy]}"
            ) from None
        for name, value in (
            ("io_workers", self.io_workers),
            ("max_queued_pages", self.max_queued_pages),
            ("batch_pages", self.batch_pages),
            ("max_finished_prefetches", self.max_finished_prefetches),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        # Validates the timeout parameters (the same errors as a prefetch's deadline).
        prefetch_deadline_s(0, self.prefetch_timeout_base_s, self.prefetch_timeout_per_1k_tokens_s)
        if not 0 <= self.write_back_free_fraction < 0.5:
            raise InvalidArgument(
                f"write_back_free_fraction must be in [0, 0.5), got {self.write_back_free_fraction!r}"
            )
