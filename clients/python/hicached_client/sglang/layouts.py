"""How an SGLang host pool's pages map onto daemon pool specs and staging buffers.

A staged page is stored *page-major*: for each of ``groups`` planes (K and V
for MHA, the latent for MLA) one contiguous chunk holding the page's rows of
every layer, in the byte order of SGLang's flat data page
(``get_data_page(index, flat=True)``), which is the layout's own: token by token for
page_first, layer by layer for layer_first and page_first_direct. Pools of two orders never
share a pool group (:func:`staged_order`): their pages would read back scrambled. The daemon
is told about the staging area as a one-layer pool whose token row spans all layers (heads 1, head_dim
``layers * heads * dim``), so it moves each page as ``groups`` contiguous
chunks, and its flat page (PutBytes/GetBytes) equals SGLang's flat data page.

Known host pools are read and written with one strided index op per batch,
through a 4-d byte view ``(planes, blocks, pages, block)`` of their buffer:

==========================  ==============================  ======  ======
SGLang pool / layout        kv_buffer                       planes  blocks
==========================  ==============================  ======  ======
MHA layer_first             (2, L, tokens, H, D)            2       L
MHA page_first              (2, tokens, L, H, D)            2       1
MHA page_first_direct       (2, pages, L, page, H, D)       2       1
MLA layer_first             (L, tokens, 1, D)               1       L
MLA page_first(_direct)     (tokens, L, 1, D) / (pages,..)  1       1
any other host pool         (via get_data_page)             1       (per page)
==========================  ==============================  ======  ======

Bindings are chosen through a registry keyed by (pool kind, layout); pools that
match no entry use the generic per-page binding. A binding never owns the host
pool's memory (SGLang does); it reads and writes it only inside ``gather`` /
``scatter``, which callers serialise per staging area.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicached_client.types import HostLayout, PoolKind

log = logging.getLogger(__name__)

_WIDE_TYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` (uint8, last dim contiguous) viewed with the widest integer type that fits.

    Page gathers run at memcpy speed only on wide element types (PERF-NOTES).
    """
    row = t.shape[-1]
    for dtype in _WIDE_TYPES:
        size = dtype.itemsize
        if row % size == 0 and t.data_ptr() % size == 0 and all(s % size == 0 for s in t.stride()[:-1]):
            return t.view(dtype)
    return t


@dataclass(frozen=True)
class PoolGeometry:
    """What the daemon is told about one pool, and the staging shape that backs it.

    Staging buffer ``g`` holds ``pages`` chunks of ``chunk_bytes``; seen by the
    daemon as ``(pages * rows_per_page, heads, head_dim)`` elements of ``dtype``.
    Buffers ``[0, num_layers)`` are K (or the MLA latent); for MHA buffers
    ``[num_layers, 2 * num_layers)`` are V.
    """

    kind: PoolKind
    dtype: torch.dtype
    host_layout: HostLayout
    groups: int
    chunk_bytes: int
    rows_per_page: int
    num_layers: int
    heads: int
    head_dim: int
    # SGLang tokens per page (host_indices are token slots).
    page_size: int

    def __post_init__(self) -> None:
        want_groups = self.num_layers * (2 if self.kind is PoolKind.MHA else 1)
        if self.groups != want_groups:
            raise ValueError(f"{self.kind.value} geometry: {self.groups} groups, expected {want_groups}")
        row_bytes = self.heads * self.head_dim * self.dtype.itemsize
        if self.rows_per_page * row_bytes != self.chunk_bytes:
            raise ValueError(
                f"geometry: chunk of {self.chunk_bytes} bytes is not {self.rows_per_page} rows of {row_bytes}"
            )

    @property
    def page_bytes(self) -> int:
        return self.groups * self.chunk_bytes


class PoolBinding(abc.ABC):
    """Copies pages between one SGLang host pool and ``(groups, n, chunk_bytes)`` byte tensors.

    ``host_pages`` are host page numbers (token slot // page_size). Not
    thread-safe for concurrent use of the same destination tensor; SGLang owns
    the host pool and guarantees the pages it passes are not in use.
    """

    def __init__(self, host_pool: Any, geometry: PoolGeometry) -> None:
        self.host_pool = host_pool
        self.geometry = geometry

    @abc.abstractmethod
    def gather(self, host_pages: torch.Tensor, out: torch.Tensor) -> None:
        """Copy pages ``host_pages`` of the host pool into ``out[:, :len(host_pages)]``."""

    @abc.abstractmethod
    def scatter(self, host_pages: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src[:, :len(host_pages)]`` into pages ``host_pages`` of the host pool."""

    @abc.abstractmethod
    def host_bytes(self) -> int:
        """Bytes of SGLang's host pool (the default daemon-side L2 size for this pool)."""

    def flat_to_chunks(self, page: torch.Tensor) -> torch.Tensor:
        """A flat data page (SGLang ``get_data_page(flat=True)``) as ``(groups, chunk_bytes)`` bytes."""
        g = self.geometry
        data = page.contiguous().view(torch.uint8)
        if data.numel() != g.page_bytes:
            raise ValueError(f"flat page has {data.numel()} bytes, a page of this pool is {g.page_bytes}")
        return data.view(g.groups, g.chunk_bytes)

    def empty_flat_page(self) -> torch.Tensor:
        """A fresh flat data page of the host pool's element type."""
        page: torch.Tensor = self.host_pool.get_dummy_flat_data_page()
        return page

    def host_pages_of(self, host_indices: torch.Tensor, num_pages: int) -> torch.Tensor:
        """Page numbers of ``num_pages`` page-aligned token-slot runs (ValueError if misaligned)."""
        ps = self.geometry.page_size
        idx = host_indices.reshape(-1)
        if idx.numel() != num_pages * ps:
            raise ValueError(f"{idx.numel()} host indices for {num_pages} pages of {ps} tokens")
        # numpy on the tensor's memory: seven torch calls on 128 numbers took 17 us a batch, these 10.
        starts = idx[::ps].cpu().numpy().astype(np.int64)
        if (starts % ps).any():
            raise ValueError(f"host indices are not page-aligned (page_size={ps}): {starts.tolist()[:8]}")
        return torch.from_numpy(starts // ps)


class ChunkedBinding(PoolBinding):
    """A pool whose ``kv_buffer`` views as ``(planes, blocks, pages, block)``: one index op per batch."""

    def __init__(self, host_pool: Any, geometry: PoolGeometry, blocks: int) -> None:
        super().__init__(host_pool, geometry)
        buf: torch.Tensor = host_pool.kv_buffer
        if not buf.is_contiguous():
            raise ValueError(f"{type(host_pool).__name__}.kv_buffer must be contiguous")
        total = buf.numel() * buf.element_size()
        num_pages = total // geometry.page_bytes
        if num_pages * geometry.page_bytes != total or geometry.chunk_bytes % blocks:
            raise ValueError(f"kv_buffer of {total} bytes is not whole pages of {geometry.page_bytes}")
        self.blocks = blocks
        self.block_bytes = geometry.chunk_bytes // blocks
        self._host = widen(buf.view(torch.uint8).view(geometry.groups, blocks, num_pages, self.block_bytes))
        self.num_pages = num_pages

    def _page_major(self, chunks: torch.Tensor) -> torch.Tensor:
        """``(planes, n, chunk)`` staging bytes as the host view's ``(planes, blocks, n, block)``."""
        g = self.geometry
        n = chunks.shape[1]
        return _same_type(chunks.view(g.groups, n, self.blocks, self.block_bytes), self._host).permute(
            0, 2, 1, 3
        )

    def gather(self, host_pages: torch.Tensor, out: torch.Tensor) -> None:
        n = host_pages.numel()
        torch.index_select(self._host, 2, host_pages, out=self._page_major(out[:, :n]))

    def scatter(self, host_pages: torch.Tensor, src: torch.Tensor) -> None:
        n = host_pages.numel()
        self._host.index_copy_(2, host_pages, self._page_major(src[:, :n]))

    def host_bytes(self) -> int:
        return self.num_pages * self.geometry.page_bytes


def _same_type(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Byte tensor ``t`` viewed with ``like``'s element type (staging chunks are 4 KiB aligned)."""
    return t if t.dtype == like.dtype else t.view(like.dtype)


class FlatPageBinding(PoolBinding):
    """Any SGLang host pool, through its flat-page API (one Python call per page)."""

    def __init__(self, host_pool: Any, page_size: int) -> None:
        dummy: torch.Tensor = host_pool.get_dummy_flat_data_page()
        self._dtype = dummy.dtype
        page_bytes = dummy.numel() * dummy.element_size()
        geometry = PoolGeometry(
            kind=PoolKind.MLA,
            dtype=torch.uint8,
            host_layout=staged_order(str(getattr(host_pool, "layout", ""))),  # its flat page's order
            groups=1,
            chunk_bytes=page_bytes,
            rows_per_page=1,
            num_layers=1,
            heads=1,
            head_dim=page_bytes,
            page_size=page_size,
        )
        super().__init__(host_pool, geometry)

    def gather(self, host_pages: torch.Tensor, out: torch.Tensor) -> None:
        ps = self.geometry.page_size
        for i, page in enumerate(host_pages.tolist()):
            data = self.host_pool.get_data_page(page * ps, flat=True)
            out[0, i].copy_(data.contiguous().view(torch.uint8))

    def scatter(self, host_pages: torch.Tensor, src: torch.Tensor) -> None:
        ps = self.geometry.page_size
        for i, page in enumerate(host_pages.tolist()):
            self.host_pool.set_from_flat_data_page(page * ps, src[0, i].view(self._dtype))

    def host_bytes(self) -> int:
        pages = int(getattr(self.host_pool, "page_num", 0) or 0)
        return pages * self.geometry.page_bytes


# ------------------------------------------------------------------ registry


def staged_order(layout: str) -> HostLayout:
    """The daemon host layout that labels how a staged page of an SGLang pool of ``layout``
    orders its rows: layer by layer (layer_first, page_first_direct: LAYER_FIRST), token by
    token (page_first: PAGE_FIRST), or in any other way (page_head, a layout this adapter does
    not know: PAGE_FIRST_DIRECT). Two orders are other bytes for the same KV, so they must
    never meet in one pool group, and the host layout is part of the group's key; for the
    daemon's one-layer pool every host layout places the bytes alike."""
    if layout in ("layer_first", "page_first_direct"):
        return HostLayout.LAYER_FIRST
    return HostLayout.PAGE_FIRST if layout == "page_first" else HostLayout.PAGE_FIRST_DIRECT


@dataclass(frozen=True)
class ChunkedLayout:
    """How one (kind, layout) of SGLang host pool splits into planes and per-layer blocks.

    ``layer_major``: the pool keeps a layer's tokens together (its chunks are gathered a layer
    block at a time).
    """

    layer_major: bool

    def describe(self, pool: Any, kind: str) -> tuple[PoolGeometry, int]:
        """(geometry, blocks per chunk) of ``pool``."""
        layers, ps = int(pool.layer_num), int(pool.page_size)
        dtype: torch.dtype = pool.dtype
        if kind == "mla":
            planes, row = 1, int(pool.kv_cache_dim)
        else:
            planes, row = 2, int(pool.head_num) * int(pool.head_dim)
        geometry = PoolGeometry(
            kind=PoolKind.MLA if kind == "mla" else PoolKind.MHA,
            dtype=dtype,
            host_layout=staged_order(str(pool.layout)),
            groups=planes,
            chunk_bytes=ps * layers * row * dtype.itemsize,
            rows_per_page=ps,
            num_layers=1,
            heads=1,
            head_dim=layers * row,
            page_size=ps,
        )
        return geometry, layers if self.layer_major else 1


# (pool kind, SGLang layout) -> how a ChunkedBinding views the pool.
CHUNKED_LAYOUTS: dict[tuple[str, str], ChunkedLayout] = {
    (kind, layout): ChunkedLayout(layer_major=layout == "layer_first")
    for kind in ("mha", "mla")
    for layout in ("layer_first", "page_first", "page_first_direct")
}


def pool_kind(pool: Any) -> str | None:
    """``"mla"``, ``"mha"`` or None, from the host pool's attributes (no SGLang import needed)."""
    if not isinstance(getattr(pool, "kv_buffer", None), torch.Tensor):
        return None
    if hasattr(pool, "kv_cache_dim"):
        return "mla"
    if hasattr(pool, "head_num") and hasattr(pool, "head_dim"):
        # SGLang's MHA host buffer uses head_dim for V too; other widths are not chunkable.
        v_dim = getattr(pool, "v_head_dim", pool.head_dim)
        return "mha" if v_dim == pool.head_dim else None
    return None


def bind_host_pool(pool: Any) -> PoolBinding:
    """The binding for an SGLang host pool: chunked when its layout is known, else per page."""
    kind = pool_kind(pool)
    layout = CHUNKED_LAYOUTS.get((kind or "", str(getattr(pool, "layout", ""))))
    if kind is not None and layout is not None:
        geometry, blocks = layout.describe(pool, kind)
        binding = ChunkedBinding(pool, geometry, blocks)
        log.debug("hicached: %s bound as %s", type(pool).__name__, geometry)
        return binding
    log.info(
        "hicached: %s (layout %r) has no chunked binding; using its per-page flat API",
        type(pool).__name__,
        getattr(pool, "layout", None),
    )
    return FlatPageBinding(pool, int(getattr(pool, "page_size", 1) or 1))
