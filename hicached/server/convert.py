"""Wire messages (hicached.v1) <-> core types. Pure conversion plus field checks.

Every conversion error is an ``InvalidArgument`` naming the field, so a bad
message never reaches the core.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from hicached_client import vocab
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

from hicached.core.checks import check_page_count
from hicached.core.stats import SessionStats
from hicached.core.types import Ack, PoolRequest, PoolRole, PoolState, WorkerId
from hicached.errors import InvalidArgument, clip
from hicached.l2.group import PoolTransfer
from hicached.l2.layout import HostLayout, KVSpec, PoolKind
from hicached.page_arrays import SMALL_BATCH
from hicached.transfer.handles import (
    DTYPE_BY_NAME,
    BufferSpec,
    CudaFdBufferHandle,
    CudaIpcBufferHandle,
    DeviceHandle,
    FdBufferHandle,
)

T = TypeVar("T")

# Wire number -> daemon value: the inverses of the client's vocabulary tables (one each).
DTYPES: dict[int, torch.dtype] = {wire: DTYPE_BY_NAME[d.value] for d, wire in vocab.DATA_TYPES.items()}
KINDS: dict[int, PoolKind] = {wire: k for k, wire in vocab.POOL_KINDS.items()}
LAYOUTS: dict[int, HostLayout] = {wire: lay for lay, wire in vocab.HOST_LAYOUTS.items()}
ROLES: dict[int, PoolRole] = {wire: r for r, wire in vocab.POOL_ROLES.items()}
# Typed Any: the generated stubs want their own enum ValueType, which is an int.
LAYOUT_TO_WIRE: Mapping[HostLayout, Any] = vocab.HOST_LAYOUTS
ROLE_TO_WIRE: Mapping[PoolRole, Any] = vocab.POOL_ROLES

# PoolSpec.data_path: a worker label (possibly empty), shown by `hicached status`.
_DATA_PATH = re.compile(r"[A-Za-z0-9._-]*")


def _enum(table: Mapping[Any, T], value: int, what: str, enum_type: object) -> T:
    if value in table:
        return table[value]
    allowed = ", ".join(enum_type.Name(k) for k in table)  # type: ignore[attr-defined]
    raise InvalidArgument(f"{what} = {value} is not supported; expected one of {allowed}")


def worker_id(identity: tpb.WorkerIdentity) -> WorkerId:
    return WorkerId(
        instance_id=identity.instance_id,
        generation=identity.generation,
        model_name=identity.model_name,
        tp_rank=identity.tp_rank,
        tp_size=max(identity.tp_size, 1),
        pp_rank=identity.pp_rank,
        pp_size=max(identity.pp_size, 1),
        tenant=identity.tenant,
    )


def buffer_spec(buf: tpb.DeviceBuffer, what: str, fds: Sequence[int] = ()) -> BufferSpec:
    """``fds``: the descriptors of this attach's handoff, indexed by ``FdHandle.fd_index``."""
    dtype = _enum(DTYPES, buf.dtype, f"{what}.dtype", tpb.DataType)
    kind = buf.handle.WhichOneof("kind")
    handle: DeviceHandle
    if kind == "shm":
        # Never open a name a client chose: see ShmHandle in types.proto.
        raise InvalidArgument(
            f"{what}.handle.shm (a /dev/shm name) is refused: hand buffers over as file descriptors "
            "(FdHandle + AttachRequest.handoff_ticket; hicached_client does this for ShmKVPool)"
        )
    if kind == "fd":
        f = buf.handle.fd
        fd = _handed_over(f.fd_index, fds, f"{what}.handle.fd")
        handle = FdBufferHandle(fd=fd, offset=f.offset, size=f.size, index=f.fd_index)
    elif kind == "cuda_fd":
        g = buf.handle.cuda_fd
        handle = CudaFdBufferHandle(
            fd=_handed_over(g.fd_index, fds, f"{what}.handle.cuda_fd"),
            allocation_size=g.allocation_size,
            offset=g.offset,
            size=g.size,
            device_id=g.device_id,
            device_uuid=g.device_uuid,
            index=g.fd_index,
        )
    elif kind == "cuda_ipc":
        c = buf.handle.cuda_ipc
        handle = CudaIpcBufferHandle(
            handle=bytes(c.handle),
            device_id=c.device_id,
            offset=c.offset,
            size=c.size,
            device_uuid=c.device_uuid,
        )
    else:
        raise InvalidArgument(f"{what}.handle is empty: set fd, cuda_fd or cuda_ipc")
    return BufferSpec(handle=handle, shape=tuple(int(x) for x in buf.shape), dtype=dtype)


def _handed_over(index: int, fds: Sequence[int], what: str) -> int:
    """The daemon's fd at ``index`` of this attach's handoff."""
    if not fds:
        raise InvalidArgument(f"{what} needs the fds handed over first: set AttachRequest.handoff_ticket")
    if index >= len(fds):
        raise InvalidArgument(f"{what}.fd_index {index} is beyond the {len(fds)} fds handed over")
    return fds[index]


def pool_request(spec: tpb.PoolSpec, index: int, fds: Sequence[int] = ()) -> PoolRequest:
    what = f"pools[{index}] ({spec.name!r})"
    kind = _enum(KINDS, spec.kind, f"{what}.kind", tpb.PoolKind)
    layout = _enum(LAYOUTS, spec.host_layout, f"{what}.host_layout", tpb.HostLayout)
    role = _enum(ROLES, spec.role, f"{what}.role", tpb.PoolRole)
    dtype = _enum(DTYPES, spec.dtype, f"{what}.dtype", tpb.DataType)
    kv = KVSpec(
        kind=kind,
        dtype=dtype,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        head_dim=spec.head_dim,
        page_size=spec.page_size,
        v_head_dim=spec.v_head_dim,
    )
    size = spec.host_size.WhichOneof("size")
    ratio = spec.host_size.ratio if size == "ratio" else None
    nbytes = spec.host_size.bytes if size == "bytes" else None
    return PoolRequest(
        name=spec.name,
        role=role,
        spec=kv,
        layout=layout,
        k_buffers=tuple(buffer_spec(b, f"{what}.k_buffers[{i}]", fds) for i, b in enumerate(spec.k_buffers)),
        v_buffers=tuple(buffer_spec(b, f"{what}.v_buffers[{i}]", fds) for i, b in enumerate(spec.v_buffers)),
        indices_from_pool=spec.indices_from_pool,
        packed_draft_layers=spec.packed_draft_layers,
        layer_ids=tuple(spec.layer_ids),
        host_ratio=ratio,
        host_bytes=nbytes,
        data_path=_data_path(spec.data_path, f"{what}.data_path"),
    )


def _data_path(value: str, what: str) -> str:
    """The worker's label, short and plain (it is shown by operators' tools)."""
    if len(value) > 32 or not _DATA_PATH.fullmatch(value):
        raise InvalidArgument(f"{what} {value[:32]!r} must be at most 32 characters of [A-Za-z0-9._-]")
    return value


def pages_in(values: Sequence[int]) -> np.ndarray:
    """A repeated int64 field as an int64 array, on the event loop of every Write, Load and
    Free. upb's repeated fields hand numpy their values in one call (``__array__``): 2.4 us
    for 1,000 pages against 35-54 us element by element; up to ``SMALL_BATCH`` pages, walking
    them is the cheaper (0.8 against 2.1 us for one page)."""
    n = len(values)
    if n <= SMALL_BATCH:
        return np.fromiter(values, dtype=np.int64, count=n)
    return np.array(values, dtype=np.int64)


def transfer_in(t: tpb.PoolTransfer) -> PoolTransfer:
    host = pages_in(t.host_pages)
    return PoolTransfer(
        name=t.pool,
        device_indices=pages_in(t.device_pages),
        host_indices=host if len(host) else None,
        host_allocated=t.host_allocated,
    )


def transfers_in(
    transfers: Sequence[tpb.PoolTransfer], *, max_pools: int, max_pages: int, more_pages: int = 0
) -> list[PoolTransfer]:
    """A request's transfers, converted on the event loop (~4 us each): first refused when there
    are more than pools a group may have (a batch names each pool at most once), so that one
    request of a million empty transfers cannot hold the loop for seconds, or more pages than
    ``server.max_batch_pages`` (device or host: a host-only list of 8 M page numbers fits in
    8 MiB, and its checks took the loop ~0.25 s); ``more_pages``: the request's others."""
    check_transfer_count(len(transfers), max_pools)
    pages = sum(max(len(t.device_pages), len(t.host_pages)) for t in transfers)
    check_page_count(more_pages + pages, max_pages)
    return [transfer_in(t) for t in transfers]


def check_transfer_count(count: int, max_pools: int) -> None:
    """InvalidArgument for more transfers than pools a group may have (gRPC and the fast lane)."""
    if count > max_pools:
        raise InvalidArgument(
            f"{count} transfers in one request: a request names each pool at most once, "
            f"and a group has at most limits.max_pools_per_attach={max_pools} pools"
        )


def batch_in(batch: tpb.TransferBatch, anchor: str, *, max_pools: int, max_pages: int) -> list[PoolTransfer]:
    """Transfers of a batch (:func:`transfers_in`); the primary pages become the anchor pool's
    transfer."""
    primary = max(len(batch.primary_device_pages), len(batch.primary_host_pages))
    out = transfers_in(batch.transfers, max_pools=max_pools, max_pages=max_pages, more_pages=primary)
    if len(batch.primary_device_pages) or len(batch.primary_host_pages):
        if any(t.name == anchor for t in out):
            raise InvalidArgument(
                f"the anchor pool {clip(anchor)} is given both as primary pages and as a transfer; give it once"
            )
        host = pages_in(batch.primary_host_pages)
        out.append(
            PoolTransfer(
                name=anchor,
                device_indices=pages_in(batch.primary_device_pages),
                host_indices=host if len(host) else None,
            )
        )
    return out


def transfer_out(t: PoolTransfer) -> tpb.PoolTransfer:
    return tpb.PoolTransfer(
        pool=t.name,
        device_pages=[] if t.device_indices is None else t.device_indices.tolist(),
        host_pages=[] if t.host_indices is None else t.host_indices.tolist(),
        host_allocated=t.host_allocated,
    )


def batch_out(transfers: Sequence[PoolTransfer]) -> tpb.TransferBatch:
    return tpb.TransferBatch(transfers=[transfer_out(t) for t in transfers])


def acks_out(acks: Iterable[Ack]) -> list[tpb.PoolAck]:
    return [tpb.PoolAck(pool=a.pool, pages=a.pages, tokens=a.tokens, bytes=a.bytes) for a in acks]


def pool_info(p: PoolState) -> tpb.PoolInfo:
    return tpb.PoolInfo(
        name=p.name,
        role=ROLE_TO_WIRE[p.role],
        host_layout=LAYOUT_TO_WIRE[p.layout],
        page_size=p.page_size,
        total_pages=p.total_pages,
        free_pages=p.free_pages,
        page_bytes=p.page_bytes,
        segment=p.segment,
    )


def identity_out(w: WorkerId) -> tpb.WorkerIdentity:
    return tpb.WorkerIdentity(
        instance_id=w.instance_id,
        generation=w.generation,
        model_name=w.model_name,
        tp_rank=w.tp_rank,
        tp_size=w.tp_size,
        pp_rank=w.pp_rank,
        pp_size=w.pp_size,
        tenant=w.tenant,
    )


__all__ = ["pb", "tpb"]


def session_info(s: SessionStats) -> pb.SessionInfo:
    return pb.SessionInfo(
        session_id=s.session_id,
        identity=identity_out(s.worker),
        group=s.group_id,
        owned_pages=s.owned_pages,
        lease_expires_unix_ms=s.lease_expires_unix_ms,
        pools=[pb.SessionPool(name=p.name, buffers=p.buffers, data_path=p.data_path) for p in s.pools],
    )
