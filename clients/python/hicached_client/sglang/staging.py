"""The shared-memory staging area an adapter exports to the daemon as its "device" pool.

One sealed memfd holds ``groups`` regions (4 KiB aligned), each
``pages`` chunks of ``chunk_bytes``. Pages ``[0, half)`` stage writes and
``[half, 2 * half)`` stage reads, so SGLang's backup and prefetch threads never
share a page. The memfd is created, populated and mapped once, at attach, and
handed to the daemon as a file descriptor; it has no name, so no crash can leave
it behind. The adapter owns the mapping and the fd; the daemon holds its own mapping.

Thread-safety: the tensors may be used from any thread; callers serialise
each half (see :class:`~hicached_client.sglang.link.PoolLink`). ``close`` and
``unlink`` are idempotent and not thread-safe.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings

import torch

from hicached_client.export import export_fd_tensor, sealed_memfd
from hicached_client.sglang.layouts import PoolGeometry
from hicached_client.v1 import types_pb2

_ALIGN = 4096


class StagingArea:
    """``chunks``: a ``(groups, 2 * half, chunk_bytes)`` uint8 view of the segment.

    ``allocated`` counts areas created in this process (the zero-copy path's tests
    read it to prove no staging buffer exists).
    """

    allocated = 0

    def __init__(self, name: str, geometry: PoolGeometry, half: int) -> None:
        if half < 1:
            raise ValueError(f"staging area needs at least one page per half, got {half}")
        if not name or "/" in name:
            raise ValueError(f"invalid staging area name {name!r}")
        self.name = name
        self.geometry = geometry
        self.half = half
        pages = 2 * half
        region = -(-pages * geometry.chunk_bytes // _ALIGN) * _ALIGN
        self._region = region
        size = region * geometry.groups
        fd = sealed_memfd(name, size)
        try:
            # Populated now: first touch of fresh memory runs at fault speed.
            self._mmap: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self.size = size
        StagingArea.allocated += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns about mmap-backed buffers
            raw = torch.frombuffer(self._mmap, dtype=torch.uint8, count=size)
        self.chunks: torch.Tensor = raw.as_strided(
            (geometry.groups, pages, geometry.chunk_bytes), (region, geometry.chunk_bytes, 1)
        )

    @property
    def write_pages(self) -> range:
        return range(0, self.half)

    @property
    def read_pages(self) -> range:
        return range(self.half, 2 * self.half)

    def write_half(self) -> torch.Tensor:
        return self.chunks[:, : self.half]

    def read_half(self) -> torch.Tensor:
        return self.chunks[:, self.half :]

    def device_buffers(self) -> tuple[list[types_pb2.DeviceBuffer], list[types_pb2.DeviceBuffer]]:
        """(k_buffers, v_buffers) describing the regions as the geometry's daemon buffers."""
        g = self.geometry
        rows = 2 * self.half * g.rows_per_page
        bufs = []
        for group in range(g.groups):
            region = self.chunks[group].reshape(-1).view(g.dtype).view(rows, g.heads, g.head_dim)
            bufs.append(export_fd_tensor(self.fd, 0, region))
        return bufs[: g.num_layers], bufs[g.num_layers :]

    @property
    def fd(self) -> int:
        """The memfd (owned here; closed by :meth:`close`)."""
        if self._fd is None:
            raise ValueError(f"staging area {self.name!r} is closed")
        return self._fd

    def unlink(self) -> None:
        """Nothing to do: a memfd has no name (kept for callers of the named-segment version)."""

    def close(self) -> None:
        """Close the fd, drop the views and unmap (deferred while a caller still holds a view)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        mm, self._mmap = self._mmap, None
        self.chunks = torch.empty(0, dtype=torch.uint8)
        if mm is not None:
            with contextlib.suppress(BufferError):  # unmapped when the last view dies
                mm.close()
