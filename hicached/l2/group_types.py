"""What a host pool group is made of and hands out (see :mod:`hicached.l2.group`).

Layer mappers, :class:`PoolEntry` (one pool of a group), the :class:`Reclaimer`
a group evicts through, :class:`PoolTransfer` and the results of resolves and
allocations. Plain data: a :class:`PoolEntry` is fixed once its group
registered it; :class:`PoolTransfer` copies are owned by whoever got them;
the frozen results are safe to hand to any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from hicached.errors import AlreadyExists, InvalidArgument, OutOfRange, clip
from hicached.l2.allocator import PageArray, as_page_array
from hicached.l2.host_pool import HostKVPool

__all__ = [
    "Allocation",
    "LayerMapper",
    "LayerRoute",
    "PoolEntry",
    "PoolTransfer",
    "Reclaimer",
    "ResolveResult",
    "copy_indices",
    "identity_layers",
    "layer_map",
    "layer_range",
]

LayerMapper = Callable[[int], int | None]
"""Global layer id -> this pool's layer, or None when the pool has no such layer."""


def identity_layers(layer: int) -> int | None:
    return layer


def layer_range(start: int, end: int) -> LayerMapper:
    """Global layers ``[start, end)`` map to pool layers ``0 .. end-start-1`` (a PP stage)."""
    if not 0 <= start <= end:
        raise InvalidArgument(f"layer range [{start}, {end}) is invalid")

    def mapper(layer: int) -> int | None:
        return layer - start if start <= layer < end else None

    return mapper


def layer_map(mapping: Mapping[int, int]) -> LayerMapper:
    """An explicit table; layers absent from it are skipped (e.g. SWA layers only)."""
    table = dict(mapping)
    return table.get


class Reclaimer(Protocol):
    """Frees cached pages of a group's pools when an allocation is short (the content index).

    Registered with :meth:`HostPoolGroup.register_reclaimer`. Ordering: for
    one allocation the group first calls :meth:`reclaimable` for every pool
    that is short, in pool-name order, and calls :meth:`reclaim` only when
    every shortfall can be freed; then :meth:`reclaim` at most once per short
    pool, in pool-name order, for what is still missing (one eviction may
    free pages of several pools). Thread-safety: both are called on the
    allocating thread with the group's (re-entrant) lock held, so the lock
    order is always group lock -> reclaimer's locks. They may free pages of
    the group's pools from that thread, but must not wait for another thread
    that uses the group, nor call back into the group's allocation.
    """

    def reclaimable(self, pool: str, wanted: int) -> int:
        """How many of ``wanted`` pages of ``pool`` :meth:`reclaim` could free now. It frees
        nothing a request that cannot fit needs; a reclaimer whose pages must be written
        elsewhere before they go may start that for a request that would then fit (the
        content index under write_back: what L3 holds is freed at once, the rest once
        written), so that a retry finds room."""
        ...

    def reclaim(self, pool: str, pages_needed: int) -> int:
        """Evict until ``pages_needed`` pages of ``pool`` are free again; the pages of ``pool`` freed."""
        ...

    def leaving(self, pool: str) -> int:
        """Pages of ``pool`` on their way out (being written elsewhere, freed after): what a
        refused allocation may soon find free."""
        ...


@dataclass
class PoolEntry:
    """One pool of the group and how it takes part in transfers (the group's reclaimer evicts)."""

    name: str
    host_pool: HostKVPool
    layer_mapper: LayerMapper = identity_layers
    is_primary_index_anchor: bool = False
    indices_from_pool: str | None = None
    packed_draft_layers: int = 0

    @property
    def target_layers(self) -> int:
        """Pool layers that belong to the target model (the packed draft layers follow them)."""
        return self.host_pool.spec.num_layers - self.packed_draft_layers

    def pool_layer(self, global_layer: int) -> int | None:
        """This pool's layer for a global layer id, or None to skip; OutOfRange on a bad mapper."""
        local = self.layer_mapper(global_layer)
        if local is not None and not 0 <= local < self.target_layers:
            raise OutOfRange(
                f"pool {self.name!r}: layer mapper sent global layer {global_layer} to layer {local}, "
                f"outside its {self.target_layers} target layers"
            )
        return local

    def draft_pool_layer(self, draft_layer: int) -> int:
        """Pool layer holding packed draft layer ``draft_layer``."""
        if not 0 <= draft_layer < self.packed_draft_layers:
            raise OutOfRange(
                f"pool {self.name!r}: draft layer {draft_layer} is out of range "
                f"[0, {self.packed_draft_layers})"
            )
        return self.target_layers + draft_layer


@dataclass
class PoolTransfer:
    """Pages of one pool that move together. Indices are 1-D int64 page numbers.

    ``host_allocated`` is True when this group allocated ``host_indices`` (and
    so ``release_transfers`` must free them). ``indices_from_pool`` marks a
    derived transfer, like the entry field of the same name.
    """

    name: str
    device_indices: PageArray | None = None
    host_indices: PageArray | None = None
    host_allocated: bool = False
    indices_from_pool: str | None = None

    def copy(self) -> PoolTransfer:
        return PoolTransfer(
            name=self.name,
            device_indices=copy_indices(self.device_indices, f"{self.name}.device_indices"),
            host_indices=copy_indices(self.host_indices, f"{self.name}.host_indices"),
            host_allocated=self.host_allocated,
            indices_from_pool=self.indices_from_pool,
        )


@dataclass(frozen=True)
class ResolveResult:
    """Outcome of a resolve: on success the resolved transfers, on failure the unchanged input."""

    ok: bool
    transfers: list[PoolTransfer] = field(default_factory=list)
    reason: str = ""


@dataclass(frozen=True)
class Allocation:
    """Outcome of :meth:`HostPoolGroup.allocate`: fresh pages per pool, or nothing and why."""

    ok: bool
    pages: dict[str, PageArray] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True)
class LayerRoute:
    """Where one global (or draft) layer lives in one pool."""

    pool: str
    pool_layer: int
    is_draft: bool = False


def copy_indices(indices: object, what: str) -> PageArray | None:
    return None if indices is None else as_page_array(indices, what)


def check_new_entry(entry: PoolEntry, entries: Mapping[str, PoolEntry], anchor: PoolEntry | None) -> None:
    """Raise unless ``entry`` may join a group of ``entries`` (whose anchor is ``anchor``):
    a new name and host pool, at most one anchor, draft layers within the pool, and a derived
    pool only from an independent one whose indices it can hold. Changes nothing."""
    name = entry.name
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"pool name must be a non-empty string, got {name!r}")
    if name in entries:
        raise AlreadyExists(f"host pool {clip(name)} is already registered")
    if not isinstance(entry.host_pool, HostKVPool):
        raise InvalidArgument(f"pool {clip(name)}: host_pool must be a HostKVPool")
    owner = next((e.name for e in entries.values() if e.host_pool is entry.host_pool), None)
    if owner is not None:
        raise AlreadyExists(f"pool {clip(name)}: its host pool is already registered as {clip(owner)}")
    if entry.is_primary_index_anchor and anchor is not None:
        raise AlreadyExists(f"pool {clip(name)} cannot be the anchor: {clip(anchor.name)} already is")
    layers = entry.host_pool.spec.num_layers
    if not isinstance(entry.packed_draft_layers, int) or not 0 <= entry.packed_draft_layers < layers:
        raise InvalidArgument(
            f"pool {clip(name)}: packed_draft_layers={entry.packed_draft_layers!r} must be in [0, {layers})"
        )
    source_name = entry.indices_from_pool
    if source_name is None:
        return
    if anchor is None or entry.is_primary_index_anchor:
        raise InvalidArgument(
            f"pool {clip(name)}: the anchor cannot derive its indices from {clip(source_name)}"
        )
    source = entries.get(source_name)
    if source is None:
        raise InvalidArgument(
            f"pool {clip(name)} derives its indices from unknown pool {clip(source_name)} "
            f"(known: {sorted(entries)})"
        )
    if source.indices_from_pool is not None:
        raise InvalidArgument(
            f"pool {clip(name)} derives from {clip(source_name)}, which is itself derived; use "
            f"{clip(source.indices_from_pool)}"
        )
    mine, theirs = entry.host_pool, source.host_pool
    if mine.num_pages < theirs.num_pages or mine.page_size != theirs.page_size:
        raise InvalidArgument(
            f"pool {clip(name)} ({mine.num_pages} pages of {mine.page_size} tokens) cannot hold the "
            f"indices of {clip(source_name)} ({theirs.num_pages} pages of {theirs.page_size} tokens)"
        )
