"""The shared-memory staging area an adapter exports to the daemon as its "device" pool.

One POSIX shm segment holds ``groups`` regions (4 KiB aligned), each
``pages`` chunks of ``chunk_bytes``. Pages ``[0, half)`` stage writes and
``[half, 2 * half)`` stage reads, so SGLang's backup and prefetch threads never
share a page. The segment is created, populated and mapped once, at attach; its
name is unlinked as soon as the daemon has mapped it, so no crash can leave it
behind. The adapter owns the mapping; the daemon holds its own.

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

from hicached_client.export import SHM_DIR, export_shm_tensor
from hicached_client.sglang.layouts import PoolGeometry
from hicached_client.v1 import types_pb2

_ALIGN = 4096


class StagingArea:
    """``chunks``: a ``(groups, 2 * half, chunk_bytes)`` uint8 view of the segment."""

    def __init__(self, name: str, geometry: PoolGeometry, half: int) -> None:
        if half < 1:
            raise ValueError(f"staging area needs at least one page per half, got {half}")
        if not name or "/" in name:
            raise ValueError(f"invalid shm segment name {name!r}")
        self.name = name
        self.geometry = geometry
        self.half = half
        pages = 2 * half
        region = -(-pages * geometry.chunk_bytes // _ALIGN) * _ALIGN
        self._region = region
        size = region * geometry.groups
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._linked = True
        try:
            os.posix_fallocate(fd, 0, size)
            # Populated now: first touch of fresh memory runs at fault speed.
            self._mmap: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self.size = size
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
            bufs.append(export_shm_tensor(self.name, 0, region))
        return bufs[: g.num_layers], bufs[g.num_layers :]

    def unlink(self) -> None:
        """Remove the segment's name (mappings stay valid)."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))

    def close(self) -> None:
        """Unlink, drop the views and unmap (deferred while a caller still holds a view)."""
        self.unlink()
        mm, self._mmap = self._mmap, None
        self.chunks = torch.empty(0, dtype=torch.uint8)
        if mm is not None:
            with contextlib.suppress(BufferError):  # unmapped when the last view dies
                mm.close()
