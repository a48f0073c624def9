"""Checks of a request against a session and its group: names, ranges, duplicates, ownership;
and of an attach's buffers against its pool specs (:func:`open_views`, which opens them).

Functions that raise the precise error (InvalidArgument, OutOfRange, NotFound,
FailedPrecondition, DoubleFree, PermissionDenied) and change nothing else; they read the
group's facts (entries, allocators, ledgers) and only go down, never back to the core.
Thread-safety: as safe as the reads they make (allocators and ledgers lock their own state).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from hicached.core.group_state import GroupState
from hicached.core.sessions import Session
from hicached.core.types import PoolRequest
from hicached.errors import (
    DoubleFree,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    clip,
)
from hicached.l2.allocator import as_page_array, first_repeat, first_repeat_of
from hicached.l2.group import PoolTransfer
from hicached.page_arrays import SMALL_BATCH, ascending
from hicached.transfer.handles import medium_of
from hicached.transfer.mappings import DeviceMappings
from hicached.transfer.plan import DevicePoolView


def check_transfers(
    session: Session,
    state: GroupState,
    transfers: Sequence[PoolTransfer],
    *,
    max_batch_pages: int,
    need_device: bool = True,
    host: str = "optional",  # "required", "optional", "forbidden"
) -> list[PoolTransfer]:
    """Validate names, lengths, ranges and duplicates; returns normalized copies."""
    check_batch_pages(transfers, max_batch_pages)  # first: the rest is O(pages)
    out = []
    seen: set[str] = set()
    for t in transfers:
        view = device_view(session, state, t.name)
        if t.name in seen:
            raise InvalidArgument(f"pool {t.name!r} appears twice in one batch")
        seen.add(t.name)
        dev = as_page_array(
            () if t.device_indices is None else t.device_indices, f"pool {t.name!r} device pages"
        )
        hst = (
            None
            if t.host_indices is None or len(t.host_indices) == 0
            else as_page_array(t.host_indices, f"pool {t.name!r} host pages")
        )
        if need_device:
            check_indices(t.name, "device", dev, view.num_pages, unique=True)
        derived = state.group.get_entry(t.name).indices_from_pool
        if host == "required" and hst is None and len(dev) and not derived:
            raise InvalidArgument(f"pool {t.name!r}: host_pages are required for this call")
        if host == "forbidden" and hst is not None:
            raise InvalidArgument(f"pool {t.name!r}: host_pages must be empty for this call")
        if hst is not None:
            if need_device and len(hst) != len(dev):
                raise InvalidArgument(
                    f"pool {t.name!r}: {len(dev)} device pages but {len(hst)} host pages (must match)"
                )
            check_indices(t.name, "host", hst, state.pool(t.name).num_pages)
        out.append(PoolTransfer(name=t.name, device_indices=dev, host_indices=hst))
    return out


def check_batch_pages(transfers: Sequence[PoolTransfer], max_batch_pages: int) -> None:
    """InvalidArgument when the transfers' pages (device, or host where there are more)
    together exceed ``max_batch_pages``: O(transfers). The servicer counts the same in the
    request before converting it (``server.convert.transfers_in``)."""
    check_page_count(
        sum(max(_count(t.device_indices), _count(t.host_indices)) for t in transfers), max_batch_pages
    )


def check_page_count(count: int, max_batch_pages: int) -> None:
    """InvalidArgument for more pages in one request than ``server.max_batch_pages``."""
    if count > max_batch_pages:
        raise InvalidArgument(
            f"batch of {count} pages exceeds server.max_batch_pages={max_batch_pages}; "
            "split it into several calls"
        )


def _count(pages: np.ndarray | None) -> int:
    return 0 if pages is None else len(pages)


def known_pool(state: GroupState, name: str) -> None:
    try:
        state.group.get_entry(name)  # a dict lookup; the entries list is built only for the message
    except NotFound:
        raise NotFound(
            f"unknown pool {clip(name)} (this session's pools: {sorted(e.name for e in state.group.entries)})"
        ) from None


def device_view(session: Session, state: GroupState, name: str) -> DevicePoolView:
    """The session's device view of a pool; byte-only pools have none."""
    known_pool(state, name)
    view = session.views.get(name)
    if view is None:
        raise FailedPrecondition(
            f"pool {clip(name)} has no device buffers in this session (byte-only): use PutBytes/GetBytes, "
            "or attach with device buffers to move pages by index"
        )
    return view


def bind_derived(state: GroupState, transfers: Sequence[PoolTransfer]) -> list[PoolTransfer]:
    """Give derived pools without pages their source's device and host pages."""
    by_name = {t.name: t for t in transfers}
    out = []
    for t in transfers:
        source = state.group.get_entry(t.name).indices_from_pool
        src = by_name.get(source) if source else None
        bound = t
        if src is not None and (t.device_indices is None or len(t.device_indices) == 0):
            bound = replace(t, device_indices=src.device_indices, host_indices=src.host_indices)
        elif src is not None and t.host_indices is None:
            bound = replace(t, host_indices=src.host_indices)
        out.append(bound)
    return out


def check_owned(session: Session, state: GroupState, transfers: Iterable[PoolTransfer]) -> None:
    for t in transfers:
        if t.host_indices is None or len(t.host_indices) == 0:
            continue
        owner_pool = state.group.get_entry(t.name).indices_from_pool or t.name
        allocated = state.pool(owner_pool).allocator.is_allocated(t.host_indices)
        owned = session.ledger.owns(owner_pool, t.host_indices)
        if (allocated & owned).all():  # one reduction on the common path, each ~1 us
            continue
        if not allocated.all():
            page = int(t.host_indices[~allocated][0])
            raise DoubleFree(f"host page {page} of pool {clip(owner_pool)} is not allocated (already freed?)")
        if not owned.all():
            page = int(t.host_indices[~owned][0])
            raise PermissionDenied(
                f"host page {page} of pool {clip(owner_pool)} is not owned by session {session.session_id}"
            )


def check_indices(pool: str, side: str, pages: np.ndarray, limit: int, *, unique: bool = True) -> None:
    """Negative or repeated pages: InvalidArgument; a page >= ``limit``: OutOfRange."""
    if len(pages) == 0:
        return
    listed = pages.tolist() if len(pages) <= SMALL_BATCH else None
    in_order = listed is None and ascending(pages)  # then its ends bound it, and nothing repeats
    if listed is not None:
        lo, hi = min(listed), max(listed)
    elif in_order:
        lo, hi = int(pages[0]), int(pages[-1])
    else:
        lo, hi = int(pages.min()), int(pages.max())
    if lo < 0:
        raise InvalidArgument(f"pool {clip(pool)}: negative {side} page index {lo}")
    if hi >= limit:
        raise OutOfRange(f"pool {clip(pool)}: {side} page {hi} out of range (pool has {limit} pages)")
    if not unique or in_order:
        return
    repeated = first_repeat(pages) if listed is None else first_repeat_of(listed)
    if repeated is not None:
        raise InvalidArgument(f"pool {clip(pool)}: duplicate {side} page {repeated}")


def open_views(mappings: DeviceMappings, pools: Sequence[PoolRequest]) -> dict[str, DevicePoolView]:
    """Open the buffers of ``pools`` in ``mappings`` (all at once) as checked device views;
    InvalidArgument when a buffer's shape or dtype does not match its pool's spec (the caller
    closes the mappings)."""
    views = {}
    tensor_pools = [p for p in pools if not p.byte_only]
    # All buffers at once: the mappings then map each fd over the span its buffers use.
    opened = iter(mappings.open_all([b for p in tensor_pools for b in (*p.k_buffers, *p.v_buffers)]))
    for p in tensor_pools:
        k = [next(opened) for _ in p.k_buffers]
        v = [next(opened) for _ in p.v_buffers]
        for i, t in enumerate((*k, *v)):
            want = (p.spec.num_heads, p.spec.head_dim)
            if tuple(t.shape[1:]) != want or t.dtype != p.spec.dtype:
                raise InvalidArgument(
                    f"pool {p.name!r} buffer {i}: shape {list(t.shape)} / dtype {t.dtype} does not match "
                    f"the pool spec (tokens, {want[0]}, {want[1]}) / {p.spec.dtype}"
                )
        if len({t.shape[0] for t in (*k, *v)}) != 1:
            raise InvalidArgument(f"pool {p.name!r}: all buffers must have the same number of tokens")
        layer_ids = list(p.layer_ids) if p.layer_ids else list(range(p.spec.num_layers))
        views[p.name] = DevicePoolView(
            name=p.name, k=k, v=v, page_size=p.spec.page_size, layer_ids=layer_ids, medium=medium_of(k[0])
        )
    return views
