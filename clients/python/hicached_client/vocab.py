"""The shared vocabulary of the wire contract: pool roles, kinds, host layouts, prefetch states, dtypes.

One definition for the client and the daemon (``hicached`` depends on
``hicached-client`` and imports these), each enum with its one table to the
``hicached.v1`` wire numbers. Plain data, immutable after import; thread-safe.
Torch dtypes are derived from :class:`DataType` names where torch is at hand
(``getattr(torch, DataType.BFLOAT16.value)``), so no second dtype table exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from hicached_client.v1 import types_pb2 as tpb


class PoolRole(StrEnum):
    """Role of a pool in a worker's pool group."""

    ANCHOR = "anchor"
    SIDECAR = "sidecar"
    DERIVED = "derived"


class PoolKind(StrEnum):
    """What a pool stores per token."""

    MHA = "mha"
    MLA = "mla"


class HostLayout(StrEnum):
    """Arrangement of a host (L2) pool (SGLang names)."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"


class PrefetchState(StrEnum):
    """State of a prefetch (the daemon's tasks use every member but ``UNSPECIFIED``,
    which only a reply without a state decodes to)."""

    UNSPECIFIED = "unspecified"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    # Stopped early: a page was missing or corrupt in L3, or L2 had no room.
    FAILED = "failed"


class DataType(StrEnum):
    """Element type of a KV buffer (torch spellings, without ``torch.``)."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    UINT8 = "uint8"
    INT8 = "int8"


# Enum <-> wire number: one table per enum, read both ways.
POOL_ROLES: Mapping[PoolRole, int] = {
    PoolRole.ANCHOR: tpb.POOL_ROLE_ANCHOR,
    PoolRole.SIDECAR: tpb.POOL_ROLE_SIDECAR,
    PoolRole.DERIVED: tpb.POOL_ROLE_DERIVED,
}
POOL_KINDS: Mapping[PoolKind, int] = {PoolKind.MHA: tpb.POOL_KIND_MHA, PoolKind.MLA: tpb.POOL_KIND_MLA}
HOST_LAYOUTS: Mapping[HostLayout, int] = {
    HostLayout.LAYER_FIRST: tpb.HOST_LAYOUT_LAYER_FIRST,
    HostLayout.PAGE_FIRST: tpb.HOST_LAYOUT_PAGE_FIRST,
    HostLayout.PAGE_FIRST_DIRECT: tpb.HOST_LAYOUT_PAGE_FIRST_DIRECT,
}
DATA_TYPES: Mapping[DataType, int] = {
    DataType.FLOAT16: tpb.DATA_TYPE_FLOAT16,
    DataType.BFLOAT16: tpb.DATA_TYPE_BFLOAT16,
    DataType.FLOAT32: tpb.DATA_TYPE_FLOAT32,
    DataType.FLOAT8_E4M3FN: tpb.DATA_TYPE_FLOAT8_E4M3FN,
    DataType.FLOAT8_E5M2: tpb.DATA_TYPE_FLOAT8_E5M2,
    DataType.UINT8: tpb.DATA_TYPE_UINT8,
    DataType.INT8: tpb.DATA_TYPE_INT8,
}
# Bytes per element, for code that sizes pages without importing torch (``hicached lookup``);
# tests/test_vocab.py holds it equal to torch's ``itemsize``.
DATA_TYPE_BYTES: Mapping[DataType, int] = {
    DataType.FLOAT16: 2,
    DataType.BFLOAT16: 2,
    DataType.FLOAT32: 4,
    DataType.FLOAT8_E4M3FN: 1,
    DataType.FLOAT8_E5M2: 1,
    DataType.UINT8: 1,
    DataType.INT8: 1,
}
