"""What a host KV pool stores (:class:`KVSpec`) and where each byte lives (layouts).

Everything is addressed in pages: page ``p`` holds token slots
``[p * page_size, (p + 1) * page_size)`` of every layer (and of K and V for
MHA). The three host layouts are the reference's; ``T`` is the number of
pages including the padding page, ``ps`` the page size, ``L`` the pool's layers
(target plus packed draft layers), ``kv`` 2 for MHA and 1 for MLA:

* ``layer_first``        ``(kv, L, T * ps, H, D)``
* ``page_first``         ``(kv, T * ps, L, H, D)``
* ``page_first_direct``  ``(kv, T, L, ps, H, D)``

A page's *flat data* is its bytes in that memory order (the reference's
``get_data_page(..., flat=True)``), so L3 reads and writes a page as the list
of contiguous extents :meth:`Layout.page_extents` returns.

Each layout is a small :class:`Layout` subclass in :data:`LAYOUTS`; a new one
is a new entry there, nothing else changes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from hicached_client import vocab

from hicached.errors import InvalidArgument

DEFAULT_HOST_RATIO = 2.0


# The client's wire vocabulary is the daemon's: one definition of each enum.
PoolKind = vocab.PoolKind
HostLayout = vocab.HostLayout


def _positive(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(f"KVSpec.{field} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class KVSpec:
    """Shape of one KV pool: immutable, validated at construction.

    ``num_layers`` counts the layers this pool stores (including packed draft
    layers). MHA keeps K and V with the same head dim (``v_head_dim`` 0 means
    "same as head_dim"); MLA keeps one latent vector per token, so
    ``num_heads`` is 1 and ``head_dim`` is the latent width
    (kv_lora_rank + qk_rope_head_dim).
    """

    kind: PoolKind
    dtype: torch.dtype
    num_layers: int
    num_heads: int
    head_dim: int
    page_size: int
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        try:
            kind = PoolKind(self.kind)
        except ValueError:
            known = ", ".join(k.value for k in PoolKind)
            raise InvalidArgument(f"KVSpec.kind {self.kind!r} is unknown (known: {known})") from None
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgument(f"KVSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        for field in ("num_layers", "num_heads", "head_dim", "page_size"):
            _positive(field, getattr(self, field))
        if not isinstance(self.v_head_dim, int) or self.v_head_dim < 0:
            raise InvalidArgument(f"KVSpec.v_head_dim must be >= 0, got {self.v_head_dim!r}")
        _KIND_RULES[kind](self)

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def num_kv(self) -> int:
        """2 for MHA (K and V), 1 for MLA (latent)."""
        return _NUM_KV[self.kind]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer of K (or V, or the latent)."""
        return self.num_heads * self.head_dim * self.itemsize

    @property
    def size_per_token(self) -> int:
        """The reference formula: (k_dim + v_dim) * heads * layers * itemsize."""
        v_dim = self.head_dim if self.kind is PoolKind.MHA else 0
        return (self.head_dim + v_dim) * self.num_heads * self.num_layers * self.itemsize

    @property
    def page_bytes(self) -> int:
        return self.size_per_token * self.page_size


def _check_mha(spec: KVSpec) -> None:
    if spec.v_head_dim not in (0, spec.head_dim):
        raise InvalidArgument(
            f"KVSpec.v_head_dim={spec.v_head_dim} differs from head_dim={spec.head_dim}: "
            "asymmetric K/V head dims are not supported; use 0 or head_dim"
        )


def _check_mla(spec: KVSpec) -> None:
    if spec.num_heads != 1:
        raise InvalidArgument(f"KVSpec.num_heads must be 1 for an MLA pool, got {spec.num_heads}")
    if spec.v_head_dim != 0:
        raise InvalidArgument(f"KVSpec.v_head_dim must be 0 for an MLA pool, got {spec.v_head_dim}")


_KIND_RULES = {PoolKind.MHA: _check_mha, PoolKind.MLA: _check_mla}
_NUM_KV = {PoolKind.MHA: 2, PoolKind.MLA: 1}


def host_pages_for(
    spec: KVSpec, *, device_tokens: int, ratio: float | None = None, nbytes: int | None = None
) -> int:
    """Usable host pages (the padding page excluded) for a ratio of the device pool or a byte budget.

    Matches the reference: ``ratio`` gives ``int(device_tokens * ratio)`` tokens,
    ``nbytes`` gives ``nbytes // size_per_token`` tokens; either is rounded down
    to whole pages, and the pool adds one padding page on top.
    """
    if (ratio is None) == (nbytes is None):
        raise InvalidArgument(f"give exactly one of ratio={ratio!r} and nbytes={nbytes!r}")
    if not isinstance(device_tokens, int) or device_tokens < 0:
        raise InvalidArgument(f"device_tokens must be a non-negative integer, got {device_tokens!r}")
    if ratio is not None:
        if not math.isfinite(ratio) or ratio <= 0:
            raise InvalidArgument(f"host ratio must be a positive finite number, got {ratio!r}")
        tokens = int(device_tokens * ratio)
        source = f"ratio {ratio} of {device_tokens} device tokens"
    else:
        assert nbytes is not None
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"host size must be a positive number of bytes, got {nbytes!r}")
        tokens = nbytes // spec.size_per_token
        source = f"{nbytes} bytes at {spec.size_per_token} bytes per token"
    pages = tokens // spec.page_size
    if pages < 1:
        raise InvalidArgument(f"{source} gives {pages} host pages of {spec.page_size} tokens; need >= 1")
    return pages


class Layout(ABC):
    """Where a layout puts each byte. Stateless; one instance per :class:`HostLayout`."""

    @abstractmethod
    def shape(self, spec: KVSpec, total_pages: int) -> tuple[int, ...]:
        """Shape of the pool's one buffer, K/V (or latent) first."""

    @abstractmethod
    def layer_pages(self, buf: torch.Tensor, spec: KVSpec, kv: int, layer: int) -> torch.Tensor:
        """View ``(total_pages, page_size, H, D)`` of one K/V layer; no copy."""

    @abstractmethod
    def page_extents(self, spec: KVSpec, total_pages: int, page: int) -> list[tuple[int, int]]:
        """``(byte offset, length)`` runs whose concatenation is the page's flat data."""


class LayerFirst(Layout):
    def shape(self, spec: KVSpec, total_pages: int) -> tuple[int, ...]:
        return (spec.num_kv, spec.num_layers, total_pages * spec.page_size, spec.num_heads, spec.head_dim)

    def layer_pages(self, buf: torch.Tensor, spec: KVSpec, kv: int, layer: int) -> torch.Tensor:
        return buf[kv, layer].view(-1, spec.page_size, spec.num_heads, spec.head_dim)

    def page_extents(self, spec: KVSpec, total_pages: int, page: int) -> list[tuple[int, int]]:
        run = spec.page_size * spec.token_bytes
        layer_stride = total_pages * run
        return _merge(
            ((kv * spec.num_layers + layer) * layer_stride + page * run, run)
            for kv in range(spec.num_kv)
            for layer in range(spec.num_layers)
        )


class PageFirst(Layout):
    def shape(self, spec: KVSpec, total_pages: int) -> tuple[int, ...]:
        return (spec.num_kv, total_pages * spec.page_size, spec.num_layers, spec.num_heads, spec.head_dim)

    def layer_pages(self, buf: torch.Tensor, spec: KVSpec, kv: int, layer: int) -> torch.Tensor:
        paged = buf[kv].view(-1, spec.page_size, spec.num_layers, spec.num_heads, spec.head_dim)
        return paged[:, :, layer]

    def page_extents(self, spec: KVSpec, total_pages: int, page: int) -> list[tuple[int, int]]:
        run = spec.page_size * spec.num_layers * spec.token_bytes
        return _merge((kv * total_pages * run + page * run, run) for kv in range(spec.num_kv))


class PageFirstDirect(Layout):
    def shape(self, spec: KVSpec, total_pages: int) -> tuple[int, ...]:
        return (
            spec.num_kv,
            total_pages,
            spec.num_layers,
            spec.page_size,
            spec.num_heads,
            spec.head_dim,
        )

    def layer_pages(self, buf: torch.Tensor, spec: KVSpec, kv: int, layer: int) -> torch.Tensor:
        return buf[kv, :, layer]

    def page_extents(self, spec: KVSpec, total_pages: int, page: int) -> list[tuple[int, int]]:
        run = spec.num_layers * spec.page_size * spec.token_bytes
        return _merge((kv * total_pages * run + page * run, run) for kv in range(spec.num_kv))


def _merge(extents: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Coalesce adjacent runs (e.g. a pool with one layer, or one page)."""
    out: list[tuple[int, int]] = []
    for offset, length in extents:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((offset, length))
    return out


LAYOUTS: dict[HostLayout, Layout] = {
    HostLayout.LAYER_FIRST: LayerFirst(),
    HostLayout.PAGE_FIRST: PageFirst(),
    HostLayout.PAGE_FIRST_DIRECT: PageFirstDirect(),
}


def layout_for(layout: HostLayout | str) -> Layout:
    try:
        return LAYOUTS[HostLayout(layout)]
    except ValueError:
        known = ", ".join(h.value for h in HostLayout)
        raise InvalidArgument(f"host layout {layout!r} is unknown (known: {known})") from None
