"""Building ``PoolSpec`` messages without touching protobuf enums.

``pool_spec`` is pure and thread-safe. The device buffers it receives are
messages that describe worker memory (``hicached_client.export`` builds them);
the worker keeps owning that memory for the whole session.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicached_client import _convert
from hicached_client.types import DataType, HostLayout, PoolKind, PoolRole
from hicached_client.v1 import types_pb2 as tpb


def data_type(value: DataType | str | object) -> int:
    """Wire number of a dtype given as ``DataType``, ``"float16"`` or a ``torch.dtype``."""
    text = value if isinstance(value, str) else str(value)
    return _convert.enum_to_wire(_convert.DATA_TYPES, DataType, text.removeprefix("torch."))


def pool_spec(
    name: str,
    *,
    role: PoolRole | str,
    kind: PoolKind | str,
    dtype: DataType | str | object,
    page_size: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    k_buffers: Sequence[tpb.DeviceBuffer],
    v_buffers: Sequence[tpb.DeviceBuffer] = (),
    host_layout: HostLayout | str = HostLayout.LAYER_FIRST,
    v_head_dim: int = 0,
    indices_from_pool: str = "",
    packed_draft_layers: int = 0,
    layer_ids: Sequence[int] | None = None,
    host_ratio: float | None = None,
    host_bytes: int | None = None,
    data_path: str = "",
) -> tpb.PoolSpec:
    """A ``PoolSpec`` for ``Attach``; strings are accepted for every enum (any case).

    ``host_ratio`` (host tokens per device token) and ``host_bytes`` size the
    host pool; give at most one (neither = the daemon's default). Structural
    checks (buffer counts, shapes, MLA rules) are the daemon's: it answers
    ``INVALID_ARGUMENT`` naming the offending field. ``data_path`` is this
    worker's own label for how the pool's pages reach it (at most 32 characters
    of ``[A-Za-z0-9._-]``); the daemon shows it per session in ``GetStats``.
    """
    if host_ratio is not None and host_bytes is not None:
        raise ValueError(
            f"pool {name!r}: give host_ratio ({host_ratio}) or host_bytes ({host_bytes}), not both"
        )
    spec = tpb.PoolSpec(
        name=name,
        role=_convert.enum_to_wire(_convert.POOL_ROLES, PoolRole, role),  # type: ignore[arg-type]
        indices_from_pool=indices_from_pool,
        kind=_convert.enum_to_wire(_convert.POOL_KINDS, PoolKind, kind),  # type: ignore[arg-type]
        dtype=data_type(dtype),  # type: ignore[arg-type]
        host_layout=_convert.enum_to_wire(_convert.HOST_LAYOUTS, HostLayout, host_layout),  # type: ignore[arg-type]
        page_size=page_size,
        num_layers=num_layers,
        packed_draft_layers=packed_draft_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        layer_ids=list(layer_ids) if layer_ids is not None else [],
        k_buffers=list(k_buffers),
        v_buffers=list(v_buffers),
        data_path=data_path,
    )
    if host_ratio is not None:
        spec.host_size.ratio = host_ratio
    elif host_bytes is not None:
        spec.host_size.bytes = host_bytes
    return spec
