"""Options of the ``file`` backend (the ``[l3.file]`` table). Frozen: thread-safe."""

from __future__ import annotations

import dataclasses

from hicached.coerce import format_size, option, parse_size, typed_fields
from hicached.errors import InvalidArgument, clip
from hicached.l3.file.layout import SLOT_ALIGN

__all__ = ["FileBackendConfig"]


@dataclasses.dataclass(frozen=True)
class FileBackendConfig:
    """Options of the ``file`` backend.

    ``path``: directory (created if missing). ``capacity_bytes``: bound on the
    bytes of occupied slots. ``max_pages``: bound on the pages stored, whatever
    their size (the index keeps each page's key in memory: docs/limits.md). ``fsync``: fdatasync each ``set`` batch before
    acknowledging it (survives power loss, costs throughput). ``io_threads``:
    threads that issue the syscalls of one batch's non-adjacent slot runs
    concurrently (random cold reads gain from queue depth; 1 = caller only).
    ``direct_io``: write and read runs of pages with ``O_DIRECT``, past the page
    cache (the daemon's L2 is the copy in memory); a filesystem or a buffer that
    refuses it goes through the page cache (:mod:`hicached.l3.file.io`).
    """

    path: str = option(help="Directory of the slot files (created if missing; one daemon at a time).")
    capacity_bytes: int = option(
        16 << 30, help="Bound on the bytes of stored pages (LRU eviction beyond).", parse=parse_size
    )
    max_pages: int = option(
        1 << 20, help="Bound on the pages stored (LRU eviction beyond): the index holds each key in memory."
    )
    fsync: bool = option(False, help="fdatasync each set batch before acknowledging it (power-loss safe).")
    io_threads: int = option(4, help="Threads issuing one batch's syscalls concurrently (1 = caller only).")
    direct_io: bool = option(
        True, help="Move pages with O_DIRECT, past the page cache (where the filesystem allows it)."
    )

    def target(self) -> str:
        """Where the pages are, for the startup line and errors."""
        return f"{self.path} (capacity {format_size(self.capacity_bytes)})"

    def __post_init__(self) -> None:
        typed_fields(self, "l3.file")  # a config built in Python is checked as a file's
        if self.io_threads < 1:
            raise InvalidArgument(
                f"file backend option 'io_threads' must be >= 1, got {clip(self.io_threads)}"
            )
        if self.max_pages < 1:
            raise InvalidArgument(f"file backend option 'max_pages' must be >= 1, got {clip(self.max_pages)}")
        if not self.path:
            raise InvalidArgument("file backend option 'path' must be a non-empty directory path")
        if self.capacity_bytes < SLOT_ALIGN:
            raise InvalidArgument(
                f"file backend option 'capacity_bytes' must be >= {SLOT_ALIGN}, got {clip(self.capacity_bytes)}"
            )
