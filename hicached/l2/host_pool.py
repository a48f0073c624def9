"""Host KV pools (L2): one shared-memory segment, one layout, one page allocator.

Segment format: a 4 KiB header, then the pool's single buffer (see
:mod:`hicached.l2.layout`). The header is JSON describing the spec, layout and
page count, behind a magic that is written last, so a re-opening daemon can
tell a complete pool of the right shape from anything else.

Pool types live in :data:`POOL_CLASSES` (PoolKind -> class). A new pool type
is a new :class:`HostKVPool` subclass plus a registry entry; nothing that uses
pools needs a new field.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import struct
from abc import ABC
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from hicached.errors import FailedPrecondition, InvalidArgument, OutOfRange
from hicached.l2.allocator import PageAllocator
from hicached.l2.layout import HostLayout, KVSpec, Layout, PoolKind, layout_for
from hicached.l2.pinning import pin_host_memory
from hicached.shm import OS_PAGE, SharedSegment

logger = logging.getLogger(__name__)

HEADER_BYTES = OS_PAGE
_MAGIC = b"HICACHL2"
_VERSION = 1
_HEADER = struct.Struct("<8sII")  # magic, version, json length


class HostKVPool(ABC):
    """A host pool of ``num_pages`` usable pages plus one padding page.

    The padding page is index ``num_pages``; it exists so that kernels that
    pad a partial copy have somewhere to write, and it is never allocated.

    Thread-safety: the allocator is thread-safe; page data is not locked --
    whoever holds a page's allocation is its only writer. :meth:`close` must
    not race with other calls.
    Buffer ownership: the pool owns its segment and the pinned registration;
    :meth:`kv_layer_pages` and :meth:`page_chunks` return views that share the
    pool's memory (valid until close; they keep the mapping alive, never
    dangle). :meth:`get_page_flat` returns a copy the caller owns.
    """

    kind: ClassVar[PoolKind]

    def __init__(self, spec: KVSpec, layout: HostLayout, num_pages: int, segment: SharedSegment) -> None:
        if getattr(type(self), "kind", None) is None:
            raise InvalidArgument(f"{type(self).__name__} has no pool kind; use a subclass in POOL_CLASSES")
        if spec.kind is not self.kind:
            raise InvalidArgument(f"{type(self).__name__} stores {self.kind.value} pools, got {spec.kind}")
        self.spec = spec
        self.layout = HostLayout(layout)
        self._geometry: Layout = layout_for(layout)
        self.num_pages = num_pages
        self.total_pages = num_pages + 1
        self.page_size = spec.page_size
        self.page_bytes = spec.page_bytes
        self.segment = segment
        # Which creation of the segment this is: a random id in its header, chosen when it is
        # created and read back when it is re-opened. A journal names the one it describes, so a
        # journal left behind is never replayed onto a later daemon's segment of the same name.
        self.incarnation = ""
        self.allocator = PageAllocator(num_pages, spec.page_size)
        shape = self._geometry.shape(spec, self.total_pages)
        self.buffer = segment.tensor(spec.dtype, shape, offset=HEADER_BYTES)
        data_bytes = self.total_pages * spec.page_bytes
        self._bytes = np.frombuffer(segment.buf, dtype=np.uint8, count=data_bytes, offset=HEADER_BYTES)
        self._unpin: Callable[[], None] | None = None
        # Every layout places page p's runs at page 0's runs shifted by p times one step: work
        # out that step once, so that a page's extents cost no per-layer arithmetic (an L3 batch
        # asks for 128 pages' chunks at a time).
        self._extents0 = self._geometry.page_extents(spec, self.total_pages, 0)
        last = self._geometry.page_extents(spec, self.total_pages, self.total_pages - 1)
        self._page_step = (last[0][0] - self._extents0[0][0]) // max(1, self.total_pages - 1)
        if last != self._shifted(self.total_pages - 1):
            raise AssertionError(f"layout {layout} does not place pages at a fixed step")
        self._page_rows = self._rows_by_page()

    @classmethod
    def required_bytes(cls, spec: KVSpec, layout: HostLayout, num_pages: int) -> int:
        """Segment size for ``num_pages`` usable pages (header and padding page included)."""
        layout_for(layout)
        return HEADER_BYTES + (num_pages + 1) * spec.page_bytes

    def kv_layer_pages(self, kv: int, layer: int) -> torch.Tensor:
        """View ``(total_pages, page_size, heads, dim)`` of K (kv=0), V (kv=1) or the MLA latent."""
        self._require_open()
        if not 0 <= kv < self.spec.num_kv:
            raise OutOfRange(f"kv index {kv} is out of range [0, {self.spec.num_kv}) for a {self.kind} pool")
        if not 0 <= layer < self.spec.num_layers:
            raise OutOfRange(f"layer {layer} is out of range [0, {self.spec.num_layers})")
        return self._geometry.layer_pages(self.buffer, self.spec, kv, layer)

    def page_extents(self, page: int) -> list[tuple[int, int]]:
        """``(offset, length)`` runs of the page's flat data, offsets relative to the data start."""
        self._check_page(page)
        return self._shifted(int(page))

    def _shifted(self, page: int) -> list[tuple[int, int]]:
        shift = page * self._page_step
        return [(off + shift, n) for off, n in self._extents0]

    def page_chunks(self, page: int) -> list[memoryview]:
        """Contiguous zero-copy byte views whose concatenation is the page's flat data."""
        view = self._bytes.data  # a memoryview slice is cheaper than a numpy one, and the same bytes
        return [view[off : off + n] for off, n in self.page_extents(page)]

    def _rows_by_page(self) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
        """The data as ``(runs of a page, total_pages, run bytes)`` when every layout run of a
        page is as long as the step between pages and the runs are evenly spaced (every layout
        here), so that one fancy-index assignment zeroes any set of pages; else None."""
        runs = self._extents0
        length = runs[0][1]
        gap = runs[1][0] - runs[0][0] if len(runs) > 1 else length * self.total_pages
        if any(n != length for _, n in runs) or self._page_step != length:
            return None
        if any(b[0] - a[0] != gap for a, b in itertools.pairwise(runs)):
            return None
        return np.lib.stride_tricks.as_strided(
            self._bytes[runs[0][0] :],
            shape=(len(runs), self.total_pages, length),
            strides=(gap, length, 1),
            writeable=True,
        )

    def zero_pages(self, pages: np.ndarray[Any, np.dtype[np.int64]]) -> None:
        """Zero every byte of ``pages`` (K and V of every layer).

        The caller owns the pages (just allocated, nobody else may read or write them);
        page data is not locked. Why: a freed page keeps its bytes, and the next session
        it is handed to must not read an earlier owner's (another tenant's) KV.
        """
        self._require_open()
        if pages.size == 0:
            return
        if not self.segment.writable:
            raise FailedPrecondition(f"pool segment {self.segment.name!r} is mapped read-only")
        if self._page_rows is not None:
            self._page_rows[:, pages, :] = 0
            return
        for page in pages.tolist():
            for off, n in self._shifted(page):
                self._bytes[off : off + n] = 0

    def get_page_flat(self, page: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """A uint8 copy of page ``page``'s flat data (``page_bytes`` long).

        With ``out`` (a contiguous uint8 CPU tensor of ``page_bytes``, owned by
        the caller) the copy lands there and ``out`` is returned; a reused
        buffer avoids first-touch faults on every call.
        """
        extents = self.page_extents(page)
        if out is None:
            out = torch.empty(self.page_bytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.numel() != self.page_bytes or not out.is_contiguous():
            raise InvalidArgument(
                f"out must be a contiguous uint8 tensor of {self.page_bytes} bytes, "
                f"got {out.dtype} with {out.numel()} elements"
            )
        dst = out.numpy().reshape(-1)
        pos = 0
        for off, n in extents:
            dst[pos : pos + n] = self._bytes[off : off + n]
            pos += n
        return out

    def set_page_flat(self, page: int, data: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Overwrite page ``page`` with ``data`` (flat bytes in this pool's layout order).

        InvalidArgument on a wrong length, OutOfRange on a bad page; nothing is
        written then.
        """
        src = _as_bytes(data)
        if src.size != self.page_bytes:
            raise InvalidArgument(
                f"page data is {src.size} bytes; page {page} of this pool is {self.page_bytes} bytes"
            )
        extents = self.page_extents(page)
        if not self.segment.writable:
            raise FailedPrecondition(f"pool segment {self.segment.name!r} is mapped read-only")
        pos = 0
        for off, n in extents:
            self._bytes[off : off + n] = src[pos : pos + n]
            pos += n

    def pin(self) -> bool:
        """Page-lock the pool for DMA when CUDA is present; True if pinned."""
        if self._unpin is None:
            self._unpin = pin_host_memory(self.buffer)
        return self._unpin is not None

    def close(self) -> None:
        """Unpin and unmap. Idempotent. The segment's name survives (see :meth:`unlink`)."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        if self.segment.closed:
            return
        del self.buffer
        del self._bytes
        self._page_rows = None  # a view of the mapping too: kept, it would keep the segment mapped
        self.segment.close()

    def unlink(self) -> None:
        """Remove the segment's name: the pool's memory is gone once every mapping closes."""
        self.segment.unlink()

    def _require_open(self) -> None:
        if self.segment.closed:
            raise FailedPrecondition(f"host pool {self.segment.name!r} is closed")

    def _check_page(self, page: int) -> None:
        self._require_open()
        if not isinstance(page, (int, np.integer)) or not 0 <= page < self.total_pages:
            raise OutOfRange(f"page {page!r} is out of range [0, {self.total_pages})")

    def describe(self) -> dict[str, Any]:
        """The header metadata: enough to check a re-opened segment matches."""
        s = self.spec
        return {
            "kind": s.kind.value,
            "dtype": str(s.dtype).removeprefix("torch."),
            "num_layers": s.num_layers,
            "num_heads": s.num_heads,
            "head_dim": s.head_dim,
            "page_size": s.page_size,
            "v_head_dim": s.v_head_dim,
            "layout": self.layout.value,
            "num_pages": self.num_pages,
        }

    def _write_header(self) -> None:
        self.incarnation = secrets.token_hex(16)
        meta = json.dumps({**self.describe(), "incarnation": self.incarnation}, sort_keys=True).encode()
        if _HEADER.size + len(meta) > HEADER_BYTES:
            raise InvalidArgument(f"pool metadata is {len(meta)} bytes; the header holds {HEADER_BYTES}")
        buf = self.segment.buf
        buf[_HEADER.size : _HEADER.size + len(meta)] = meta
        buf[: _HEADER.size] = _HEADER.pack(_MAGIC, _VERSION, len(meta))

    def _check_header(self) -> None:
        buf = self.segment.buf
        magic, version, length = _HEADER.unpack(bytes(buf[: _HEADER.size]))
        name = self.segment.name
        if magic != _MAGIC or version != _VERSION or length > HEADER_BYTES - _HEADER.size:
            raise FailedPrecondition(f"segment {name!r} is not a complete hicached v{_VERSION} host pool")
        stored = json.loads(bytes(buf[_HEADER.size : _HEADER.size + length]))
        incarnation = stored.get("incarnation") if isinstance(stored, dict) else None
        self.incarnation = incarnation if isinstance(incarnation, str) else ""
        wanted = self.describe()
        diff = {k: (stored.get(k), v) for k, v in wanted.items() if stored.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: stored {a!r}, wanted {b!r}" for k, (a, b) in sorted(diff.items()))
            raise FailedPrecondition(f"segment {name!r} holds a different pool ({detail})")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.segment.name!r}, layout={self.layout.value}, "
            f"pages={self.num_pages}, page_bytes={self.page_bytes})"
        )


class MHAHostPool(HostKVPool):
    """K and V for every layer; ``kv_layer_pages(0|1, layer)``."""

    kind = PoolKind.MHA


class MLAHostPool(HostKVPool):
    """One latent vector per token and layer; ``kv_layer_pages(0, layer)``."""

    kind = PoolKind.MLA


POOL_CLASSES: dict[PoolKind, type[HostKVPool]] = {
    PoolKind.MHA: MHAHostPool,
    PoolKind.MLA: MLAHostPool,
}


def _pool_class(spec: KVSpec) -> type[HostKVPool]:
    try:
        return POOL_CLASSES[spec.kind]
    except KeyError:
        raise InvalidArgument(f"no host pool class is registered for kind {spec.kind!r}") from None


def _check_pages(num_pages: int) -> None:
    if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
        raise InvalidArgument(f"a host pool needs at least one usable page, got num_pages={num_pages!r}")


def create_host_pool(
    spec: KVSpec,
    layout: HostLayout,
    num_pages: int,
    *,
    segment_name: str,
    prefault: bool = True,
    pin: bool = True,
) -> HostKVPool:
    """Create a pool in a new shared-memory segment (AlreadyExists if the name is taken).

    The memory is reserved and prefaulted now, and pinned when CUDA is present
    and ``pin`` is set. On any error the segment is removed again.
    """
    _check_pages(num_pages)
    cls = _pool_class(spec)
    segment = SharedSegment.create(
        segment_name, cls.required_bytes(spec, layout, num_pages), prefault=prefault
    )
    try:
        pool = cls(spec, layout, num_pages, segment)
        if pin:
            pool.pin()
        pool._write_header()
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    return pool


def open_host_pool(
    spec: KVSpec,
    layout: HostLayout,
    num_pages: int,
    *,
    segment_name: str,
    prefault: bool = True,
    pin: bool = True,
) -> HostKVPool:
    """Re-map an existing pool (warm restart). Its page data is kept; every page starts free.

    NotFound if the segment is absent; FailedPrecondition if it is incomplete or
    holds a pool of another shape. The caller replays its journal with
    ``pool.allocator.mark_allocated``.
    """
    _check_pages(num_pages)
    cls = _pool_class(spec)
    segment = SharedSegment.open(segment_name, writable=True)
    try:
        need = cls.required_bytes(spec, layout, num_pages)
        if segment.size != need:
            raise FailedPrecondition(
                f"segment {segment_name!r} is {segment.size} bytes; this pool needs {need}"
            )
        pool = cls(spec, layout, num_pages, segment)
        pool._check_header()
        pool.allocator.mark_all_dirty()  # the free pages hold whatever the last daemon left
        if prefault:
            # Re-mapping is lazy; fault the page tables in now, as at creation.
            segment.prefault()
        if pin:
            pool.pin()
    except BaseException:
        segment.close()
        raise
    return pool


def _as_bytes(data: torch.Tensor | bytes | bytearray | memoryview) -> np.ndarray[Any, np.dtype[np.uint8]]:
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise InvalidArgument(f"page data must be on the CPU, got a tensor on {data.device}")
        t = data.detach().contiguous().reshape(-1)
        return t.view(torch.uint8).numpy()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    raise InvalidArgument(f"page data must be a tensor or bytes-like, got {type(data).__name__}")
