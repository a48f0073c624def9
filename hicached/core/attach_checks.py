"""The rules an attach's identity and pools must follow, checked before anything is mapped
or allocated (:class:`hicached.core.service.HiCacheCore` before it opens a mapping, the group
registry again before it builds). Pure functions of their arguments: thread-safe."""

from __future__ import annotations

from collections.abc import Sequence

from hicached.core.types import PoolRequest, PoolRole, WorkerId
from hicached.core.warm import GROUP_ID_LIKE
from hicached.errors import AlreadyExists, InvalidArgument, clip


def validate_worker(worker: WorkerId) -> None:
    """The worker's position must lie inside its parallel layout (checked on every attach)."""
    if not 0 <= worker.tp_rank < worker.tp_size:
        raise InvalidArgument(f"identity.tp_rank={worker.tp_rank} must lie in [0, tp_size={worker.tp_size})")
    if not 0 <= worker.pp_rank < worker.pp_size:
        raise InvalidArgument(f"identity.pp_rank={worker.pp_rank} must lie in [0, pp_size={worker.pp_size})")


def validate_pool_requests(pools: Sequence[PoolRequest]) -> None:
    """Group-level rules checked before anything is allocated."""
    if not pools:
        raise InvalidArgument("attach needs at least one pool")
    names = [p.name for p in pools]
    for name in names:
        if not name:
            raise InvalidArgument("pool name must not be empty")
        if GROUP_ID_LIKE.match(name):
            # A warm-restart segment is <prefix>-<group id>-<pool>: a pool named so would make
            # its segments look like those of the shm prefix <prefix>-<16 hex> (docs/deploy.md).
            raise InvalidArgument(
                f"pool name {clip(name)} must not start with 16 hex digits and '-' (the form of a "
                "group id in segment names)"
            )
        if names.count(name) > 1:
            raise AlreadyExists(f"duplicate pool name {clip(name)} in attach")
    anchors = [p.name for p in pools if p.role is PoolRole.ANCHOR]
    if len(anchors) != 1:
        raise InvalidArgument(f"a pool group needs exactly one anchor pool, got {len(anchors)}: {anchors}")
    for p in pools:
        if p.role is PoolRole.DERIVED:
            if p.indices_from_pool not in names or p.indices_from_pool == p.name:
                raise InvalidArgument(
                    f"derived pool {p.name!r} reuses indices of {p.indices_from_pool!r}, "
                    f"which is not another pool of this attach (pools: {names})"
                )
        elif p.indices_from_pool:
            raise InvalidArgument(f"pool {p.name!r}: indices_from_pool is only valid for derived pools")
        if p.layer_ids and len(p.layer_ids) != p.spec.num_layers:
            raise InvalidArgument(
                f"pool {p.name!r}: layer_ids has {len(p.layer_ids)} entries, expected num_layers={p.spec.num_layers}"
            )
        mapped = [g for g in p.layer_ids if g != -1]
        if any(g < -1 for g in p.layer_ids) or len(set(mapped)) != len(mapped):
            bad = next((g for g in p.layer_ids if g < -1 or mapped.count(g) > 1), None)
            raise InvalidArgument(
                f"pool {p.name!r}: layer id {bad} is invalid (each must be a distinct global layer id >= 0, "
                "or -1 for a layer not driven by progress)"
            )
        if not 0 <= p.packed_draft_layers <= p.spec.num_layers:
            raise InvalidArgument(
                f"pool {p.name!r}: packed_draft_layers={p.packed_draft_layers} exceeds num_layers={p.spec.num_layers}"
            )
        if p.byte_only:
            if p.host_bytes is None:
                raise InvalidArgument(
                    f"pool {p.name!r} has no device buffers (a byte-only pool for PutBytes/GetBytes): "
                    "its host size must be given in bytes (host_size.bytes), a ratio has no device pool to scale"
                )
            continue
        want_v = p.spec.num_kv == 2
        if len(p.k_buffers) != p.spec.num_layers or len(p.v_buffers) != (p.spec.num_layers if want_v else 0):
            raise InvalidArgument(
                f"pool {p.name!r}: expected {p.spec.num_layers} k_buffers and "
                f"{p.spec.num_layers if want_v else 0} v_buffers, got {len(p.k_buffers)} and {len(p.v_buffers)}"
            )
        for i, buf in enumerate((*p.k_buffers, *p.v_buffers)):
            if len(buf.shape) != 3 or buf.shape[0] <= 0 or buf.shape[0] % p.spec.page_size:
                raise InvalidArgument(
                    f"pool {p.name!r} buffer {i}: shape {list(buf.shape)} must be (tokens, heads, dim) "
                    f"with tokens a positive multiple of page_size={p.spec.page_size}"
                )
