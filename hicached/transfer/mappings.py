"""The device buffers of one worker session: each handed-over allocation mapped once per
run of nearby buffers, and the tensor views over them.

Split from :mod:`hicached.transfer.handles` (the handle kinds and their openers): this
module decides *what* to map -- for an fd, only the span a session's buffers use, since
the file's size is the client's choice -- and owns the mappings until the session ends.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicached.errors import FailedPrecondition, InvalidArgument
from hicached.transfer.handles import BufferSpec, HandleOpener, OpenedAllocation, opener_for, validate_spec

# Buffers of one fd closer than this share one mapping (gap included); farther
# apart, each run gets its own. Why split: a client chooses the offsets, and two
# small buffers at 0 and 64 TiB of a sparse memfd would otherwise map 64 TiB of
# the daemon's address space. Why not one mapping per buffer: a worker's K/V
# buffers are usually contiguous, and one mapping is one mmap and one populate.
SPAN_MAX_GAP = 1 << 20


@dataclass(frozen=True)
class _Run:
    """Buffers of one allocation that one mapping covers: ``[start, end)``, specs by index."""

    start: int
    end: int
    indices: tuple[int, ...]


def _runs(extents: Sequence[tuple[int, int]], indices: Sequence[int], max_gap: float) -> list[_Run]:
    """Cluster the buffers ``indices`` (all in one allocation; ``extents[i]`` is buffer i's
    (offset, bytes)) into runs, by offset, cutting where one starts more than ``max_gap``
    bytes after the run so far ends.

    What bounds the bytes mapped: each run spans its buffers plus gaps of at most
    SPAN_MAX_GAP between them, plus under mmap.ALLOCATIONGRANULARITY of rounding at
    its start -- so a session maps at most the bytes its buffers declare plus
    ~1 MiB per buffer (an attach has at most limits.max_buffers_per_attach). The
    file's size plays no part. The buffers' own sizes are what the worker declares
    (the attach checks heads, head_dim and dtype against the pool spec, not the token
    count): what bounds them is ``limits.max_buffer_bytes_per_peer``, checked before
    the attach maps anything (:mod:`hicached.server.peers`).
    """
    order = sorted(indices, key=lambda i: extents[i][0])
    runs: list[_Run] = []
    start = end = -1
    members: list[int] = []
    for i in order:
        offset, nbytes = extents[i]
        if members and offset > end + max_gap:
            runs.append(_Run(start, end, tuple(members)))
            members = []
        if not members:
            start, end = offset, offset
        members.append(i)
        end = max(end, offset + nbytes)
    if members:
        runs.append(_Run(start, end, tuple(members)))
    return runs


def fd_span_count(buffers: Sequence[tuple[int, int, int]]) -> int:
    """How many mappings an attach of these memfd buffers, each (fd, offset, bytes), makes at
    most: one per run of nearby buffers of each fd (:func:`_runs`; descriptors of one memfd
    count apart, so this errs high). What ``limits.max_mappings_per_peer`` counts, before
    anything is mapped: each mapping is one of the kernel's ``vm.max_map_count`` for the
    whole daemon."""
    by_fd: dict[int, list[int]] = {}
    for i, (fd, _, _) in enumerate(buffers):
        by_fd.setdefault(fd, []).append(i)
    extents = [(offset, max(nbytes, 0)) for _, offset, nbytes in buffers]
    return sum(len(_runs(extents, indices, SPAN_MAX_GAP)) for indices in by_fd.values())


class DeviceMappings:
    """The device buffers of one worker session.

    Maps each handed-over fd / IPC allocation once per run of nearby buffers
    (only the bytes the buffers span, for fds: see :func:`_runs`), hands out
    validated tensor views, and closes every mapping exactly once in
    :meth:`close`. The views borrow the worker's memory: they are valid until
    :meth:`close`, and the worker keeps owning (and eventually freeing) the memory;
    this object owns the mappings. Thread-safe. A failed :meth:`open_all` leaves
    no new mapping behind.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Hashable, list[OpenedAllocation]] = {}
        self._closed = False

    def open(self, spec: BufferSpec) -> torch.Tensor:
        """A tensor view of ``spec``: :meth:`open_all` of one buffer."""
        return self.open_all([spec])[0]

    def open_all(self, specs: Sequence[BufferSpec]) -> list[torch.Tensor]:
        """Tensor views of ``specs`` (shapes and dtypes as declared), in order.

        Seeing every buffer of an attach at once is what lets an fd be mapped only
        over the span its buffers use. An allocation mapped by an earlier call is
        reused when it covers the buffers. InvalidArgument for a bad spec or a range
        beyond the allocation, NotFound when the allocation does not exist,
        FailedPrecondition after :meth:`close`.
        """
        sizes = [validate_spec(spec) for spec in specs]
        groups: dict[Hashable, tuple[HandleOpener[Any], list[int]]] = {}
        for i, spec in enumerate(specs):
            opener = opener_for(spec.handle)
            groups.setdefault(opener.key(spec.handle), (opener, []))[1].append(i)
        extents = [(spec.handle.offset, n) for spec, n in zip(specs, sizes, strict=True)]
        views: list[torch.Tensor | None] = [None] * len(specs)
        with self._lock:
            if self._closed:
                raise FailedPrecondition("device mappings of this session are closed")
            fresh: list[tuple[Hashable, OpenedAllocation]] = []
            try:
                for key, (opener, indices) in groups.items():
                    # An opener that maps whole allocations gets one run: one mapping for all.
                    max_gap = SPAN_MAX_GAP if opener.maps_spans else math.inf
                    for run in _runs(extents, indices, max_gap):
                        alloc = self._covering(key, opener, run, fresh)
                        if alloc is None:
                            alloc = opener.open_span(specs[run.indices[0]].handle, run.start, run.end)
                            fresh.append((key, alloc))
                        for i in run.indices:
                            views[i] = self._view(alloc, specs[i], sizes[i])
            except BaseException:
                views.clear()  # drop views of fresh mappings before closing them
                for _, alloc in fresh:
                    alloc.close()
                raise
            for key, alloc in fresh:
                self._open.setdefault(key, []).append(alloc)
        return [v for v in views if v is not None]

    def _covering(
        self,
        key: Hashable,
        opener: HandleOpener[Any],
        run: _Run,
        fresh: list[tuple[Hashable, OpenedAllocation]],
    ) -> OpenedAllocation | None:
        """A mapping of ``key`` already open (before or in this call) to serve ``run``; lock held."""
        known = self._open.get(key, []) + [a for k, a in fresh if k == key]
        if not opener.maps_spans:
            return known[0] if known else None
        for alloc in known:
            if alloc.base <= run.start and run.end <= alloc.base + alloc.size:
                return alloc
        return None

    @staticmethod
    def _view(alloc: OpenedAllocation, spec: BufferSpec, nbytes: int) -> torch.Tensor:
        offset = spec.handle.offset
        end = offset + nbytes
        if offset < alloc.base or end > alloc.base + alloc.size:
            raise InvalidArgument(f"buffer [{offset}, {end}) exceeds its allocation of {alloc.size} bytes")
        return alloc.view(offset - alloc.base, spec.dtype, spec.shape)

    @property
    def open_count(self) -> int:
        """How many mappings (allocations, or spans of one) are open now."""
        with self._lock:
            return sum(len(allocs) for allocs in self._open.values())

    def close(self) -> None:
        """Unmap everything; idempotent. Views handed out become invalid."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            allocs = [alloc for group in self._open.values() for alloc in group]
            self._open.clear()
        errors: list[BaseException] = []
        for alloc in allocs:
            try:
                alloc.close()
            except Exception as exc:  # keep closing the others, then report
                errors.append(exc)
        if errors:
            raise errors[0]
