"""Copy planning: turn (device pool, host pool, page pairs) into per-layer page copies.

:func:`build_plan` validates everything before anything is copied, so a rejected
request changes nothing. A plan only references tensors; it owns no memory: the
device views belong to the session's :class:`~hicached.transfer.mappings.DeviceMappings`
and the host views to the host pools, both of which must outlive the plan's execution.
Plans are immutable and may be shared between threads.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple, Protocol

import numpy as np
import torch

from hicached.errors import InvalidArgument, OutOfRange, clip
from hicached.page_arrays import SMALL_BATCH, ascending
from hicached.transfer.handles import Medium, medium_of
from hicached.transfer.words import CopyRows, copy_rows

TAIL_LAYER = -1  # global layer id of pool layers after the last mapped one (draft layers)


class HostSpecLike(Protocol):
    """The fields of ``hicached.l2`` ``KVSpec`` that planning reads."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv(self) -> int: ...

    @property
    def page_size(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...


class HostPoolLike(Protocol):
    """What planning needs from a host pool (``hicached.l2.host_pool.HostKVPool``)."""

    @property
    def spec(self) -> HostSpecLike: ...

    @property
    def total_pages(self) -> int: ...

    def kv_layer_pages(self, kv: int, layer: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class DevicePoolView:
    """A worker's device pool as the daemon sees it: one tensor per pool layer.

    ``k[i]`` / ``v[i]`` are (tokens, heads, dim) views (``v`` is empty for MLA);
    ``layer_ids[i]`` is the global layer id of pool layer ``i`` (-1: a layer after
    the last mapped one, e.g. a packed draft layer).
    """

    name: str
    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]
    page_size: int
    layer_ids: Sequence[int]
    medium: Medium

    @functools.cached_property
    def num_pages(self) -> int:  # read by every request's checks; the buffers never change
        return int(self.k[0].shape[0]) // self.page_size if self.k else 0


class Direction(enum.StrEnum):
    D2H = "d2h"
    H2D = "h2d"


class PageCopy(NamedTuple):
    """Copy ``src[src_pages[i]]`` to ``dst[dst_pages[i]]``; src/dst are shaped (pages, ...).

    A tuple, as :class:`LayerStep`: the planner makes one per layer and K/V of every copy
    (64 for a 32-layer model), and a frozen dataclass costs several times more to build."""

    src: torch.Tensor
    dst: torch.Tensor
    src_pages: np.ndarray
    dst_pages: np.ndarray
    # (src, dst) as matched word rows (hicached.transfer.words), when the planner had them
    # cached; the CPU route computes them otherwise.
    rows: CopyRows | None = None
    # Bytes of one page of src, when the planner had them cached (a tensor's shape and
    # element size cost ~1 us each to read: a few percent of a one-page Write).
    page_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        page = self.page_bytes if self.page_bytes is not None else page_nbytes(self.src)
        return len(self.src_pages) * page


class LayerStep(NamedTuple):
    """Copies of one global layer (or of the tail, layer -1), done before it is reported;
    ``nbytes``: their bytes, where the planner counted them (None: count them)."""

    layer: int
    copies: tuple[PageCopy, ...]
    nbytes: int | None = None


@dataclass(frozen=True)
class CopyPlan:
    direction: Direction
    steps: tuple[LayerStep, ...]
    nbytes: int
    tokens_by_pool: Mapping[str, int]
    bytes_by_pool: Mapping[str, int]


def page_nbytes(pages: torch.Tensor) -> int:
    """Bytes of one page of a (pages, ...) tensor."""
    return math.prod(pages.shape[1:]) * pages.element_size()


Item = tuple[DevicePoolView, HostPoolLike, np.ndarray, np.ndarray]
Layers = list[tuple[int, torch.Tensor, torch.Tensor]]
Rows = list[CopyRows | None]


@dataclass
class CheckedPool:
    """What build_plan remembers of one (view, host pool) pair: its checked layers and,
    per direction, each layer's (source, destination) word rows (CPU layers only)."""

    view: DevicePoolView
    host: HostPoolLike
    layers: Layers
    rows: dict[Direction, Rows] = field(default_factory=dict)
    page_bytes: list[int] = field(init=False)  # per layer; the device and host pages match

    def __post_init__(self) -> None:
        self.page_bytes = [page_nbytes(dev) for _, dev, _ in self.layers]


# What build_plan may remember between calls: pool name -> CheckedPool.
LayerCache = MutableMapping[str, CheckedPool]


def build_plan(direction: Direction, items: Sequence[Item], *, cache: LayerCache | None = None) -> CopyPlan:
    """Plan the copies of ``items`` = (device view, host pool, device_pages, host_pages) per pool.

    D2H copies device pages to host pages, H2D the reverse. Everything is validated
    first (InvalidArgument / OutOfRange naming the pool and the offending value), so
    a rejected plan never leads to a partial copy. Steps come in ascending global
    layer order with the tail (-1) last; a step holds every pool's copies of its layer.

    ``cache`` (owned by the caller, e.g. one per session, and dropped with it) keeps the
    check of each (view, host pool) pair and its per-layer page views: they never change,
    and checking them costs more than planning a small copy. An entry is used only for
    the very same view and pool objects. It references the views' tensors: whoever owns
    it must drop it when the views' memory is unmapped.
    """
    if type(direction) is not Direction:
        direction = Direction(direction)
    by_layer: dict[int, list[PageCopy]] = {}
    bytes_by_layer: dict[int, int] = {}
    tokens: dict[str, int] = {}
    nbytes_by_pool: dict[str, int] = {}
    for item in items:
        view, host, dev_pages, host_pages = item
        if view.name in tokens:
            raise InvalidArgument(f"pool {view.name!r} appears twice in one transfer")
        dev_pages = _pages(view.name, "device", dev_pages)
        host_pages = _pages(view.name, "host", host_pages)
        if len(dev_pages) != len(host_pages):
            raise InvalidArgument(
                f"pool {view.name!r}: {len(dev_pages)} device pages but {len(host_pages)} host pages"
            )
        hit = cache.get(view.name) if cache is not None else None
        if hit is None or hit.view is not view or hit.host is not host:
            hit = CheckedPool(view, host, _check_pool(view, host))
            if cache is not None:
                cache[view.name] = hit
        layers = hit.layers
        rows = _rows(hit, direction) if cache is not None else [None] * len(layers)
        page_bytes = hit.page_bytes
        dev_sorted = _check_range(view.name, "device", dev_pages, view.num_pages)
        host_sorted = _check_range(view.name, "host", host_pages, int(host.total_pages))
        dst_kind, dst_pages, dst_sorted = (
            ("host", host_pages, host_sorted)
            if direction is Direction.D2H
            else ("device", dev_pages, dev_sorted)
        )
        if not dst_sorted:  # a strictly ascending batch has no repeat: not checked twice
            _check_unique(view.name, dst_kind, dst_pages)
        tokens[view.name] = len(dev_pages) * view.page_size
        pool_bytes = 0
        if len(dev_pages):
            for (layer_id, dev, host_t), pair, page in zip(layers, rows, page_bytes, strict=True):
                src, dst, sp, dp = (
                    (dev, host_t, dev_pages, host_pages)
                    if direction is Direction.D2H
                    else (host_t, dev, host_pages, dev_pages)
                )
                nbytes = len(sp) * page
                pool_bytes += nbytes
                by_layer.setdefault(layer_id, []).append(PageCopy(src, dst, sp, dp, pair, page))
                bytes_by_layer[layer_id] = bytes_by_layer.get(layer_id, 0) + nbytes
        nbytes_by_pool[view.name] = pool_bytes
    order = sorted(by_layer, key=lambda layer: (layer == TAIL_LAYER, layer))
    steps = tuple(LayerStep(layer, tuple(by_layer[layer]), bytes_by_layer[layer]) for layer in order)
    return CopyPlan(
        direction=direction,
        steps=steps,
        nbytes=sum(nbytes_by_pool.values()),
        tokens_by_pool=MappingProxyType(tokens),
        bytes_by_pool=MappingProxyType(nbytes_by_pool),
    )


def _rows(checked: CheckedPool, direction: Direction) -> Rows:
    """The word rows of each layer's (source, destination) in ``direction``, made once."""
    rows = checked.rows.get(direction)
    if rows is None:
        rows = []
        for _, dev, host_t in checked.layers:
            src, dst = (dev, host_t) if direction is Direction.D2H else (host_t, dev)
            cpu = medium_of(src) is Medium.CPU and medium_of(dst) is Medium.CPU
            rows.append(copy_rows(src, dst) if cpu else None)
        checked.rows[direction] = rows
    return rows


def _pages(pool: str, kind: str, pages: object) -> np.ndarray:
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise InvalidArgument(f"pool {clip(pool)}: {kind} pages must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":  # np.issubdtype costs several times more
        raise InvalidArgument(f"pool {clip(pool)}: {kind} pages must be integers, got dtype {arr.dtype}")
    # A private, contiguous int64 copy: the plan must not see later edits by the caller.
    return np.array(arr, dtype=np.int64, copy=True, order="C")


def _check_range(pool: str, kind: str, pages: np.ndarray, limit: int) -> bool:
    """OutOfRange naming the first page outside [0, limit); True when a batch over
    SMALL_BATCH was found strictly ascending, so that it has no repeat either."""
    if not len(pages):
        return False
    if len(pages) <= SMALL_BATCH:
        listed = pages.tolist()
        if min(listed) >= 0 and max(listed) < limit:
            return False
    elif pages[0] >= 0 and pages[-1] < limit and ascending(pages):
        return True
    bad = np.flatnonzero((pages < 0) | (pages >= limit))
    if len(bad):
        i = int(bad[0])
        raise OutOfRange(
            f"pool {clip(pool)}: {kind} page {int(pages[i])} at position {i} is out of range [0, {limit})"
        )
    return False


def _check_unique(pool: str, kind: str, pages: np.ndarray) -> None:
    if len(pages) < 2:
        return
    if len(pages) <= SMALL_BATCH and len(set(pages.tolist())) == len(pages):
        return
    order = np.argsort(pages, kind="stable")
    sorted_pages = pages[order]
    dup = np.flatnonzero(sorted_pages[1:] == sorted_pages[:-1])
    if len(dup):
        j = int(dup[0])
        raise InvalidArgument(
            f"pool {clip(pool)}: destination {kind} page {int(sorted_pages[j])} appears twice "
            f"(positions {int(order[j])} and {int(order[j + 1])})"
        )


def _check_pool(view: DevicePoolView, host: HostPoolLike) -> Layers:
    """Check a device view against its host pool; (global layer, device pages, host pages) per buffer."""
    spec = host.spec
    name = view.name
    if view.page_size != spec.page_size:
        raise InvalidArgument(
            f"pool {clip(name)}: device page size {view.page_size} != host {spec.page_size}"
        )
    if len(view.k) != spec.num_layers:
        raise InvalidArgument(
            f"pool {clip(name)}: {len(view.k)} device K buffers != {spec.num_layers} layers"
        )
    want_v = spec.num_layers if spec.num_kv == 2 else 0
    if len(view.v) != want_v:
        raise InvalidArgument(f"pool {clip(name)}: {len(view.v)} device V buffers, expected {want_v}")
    if len(view.layer_ids) != spec.num_layers:
        raise InvalidArgument(
            f"pool {clip(name)}: {len(view.layer_ids)} layer ids != {spec.num_layers} layers"
        )
    tokens = int(view.k[0].shape[0]) if view.k else 0
    if tokens % view.page_size:
        raise InvalidArgument(f"pool {clip(name)}: {tokens} device tokens is not a multiple of page size")
    out: Layers = []
    for kv, buffers in enumerate((view.k, view.v)):
        for layer, buf in enumerate(buffers):
            label = f"pool {clip(name)} {'KV'[kv]} layer {layer}"
            layer_id = view.layer_ids[layer]
            if type(layer_id) is not int or layer_id < TAIL_LAYER:
                raise InvalidArgument(f"{label}: invalid global layer id {layer_id!r}")
            if medium_of(buf) is not view.medium:
                raise InvalidArgument(f"{label}: buffer on {buf.device}, pool declares {view.medium}")
            host_pages = host.kv_layer_pages(kv, layer)
            if buf.dtype != host_pages.dtype:
                raise InvalidArgument(f"{label}: device dtype {buf.dtype} != host dtype {host_pages.dtype}")
            if buf.dim() != 3 or buf.shape[0] != tokens:
                raise InvalidArgument(f"{label}: device shape {tuple(buf.shape)}, expected ({tokens}, H, D)")
            page_shape = (view.page_size, *buf.shape[1:])
            if page_shape != tuple(host_pages.shape[1:]):
                host_shape = tuple(host_pages.shape[1:])
                raise InvalidArgument(f"{label}: device page shape {page_shape} != host {host_shape}")
            # Splitting the token dimension is always a view, whatever the strides.
            dev_pages = buf.view(tokens // view.page_size, *page_shape)
            out.append((layer_id, dev_pages, host_pages))
    return out
