"""L2: host-memory KV pools in shared memory, their page allocator and pool groups.

Pure Python + torch: nothing here knows about gRPC, and CUDA appears only in
:mod:`hicached.l2.pinning`.
"""

from hicached.l2.allocator import PageAllocator
from hicached.l2.group import (
    HostPoolGroup,
    LayerMapper,
    LayerRoute,
    PoolEntry,
    PoolTransfer,
    Reclaimer,
    ResolveResult,
    identity_layers,
    layer_map,
    layer_range,
)
from hicached.l2.host_pool import (
    POOL_CLASSES,
    HostKVPool,
    MHAHostPool,
    MLAHostPool,
    create_host_pool,
    open_host_pool,
)
from hicached.l2.layout import DEFAULT_HOST_RATIO, HostLayout, KVSpec, PoolKind, host_pages_for
from hicached.l2.pinning import pin_host_memory
from hicached.shm import SharedSegment

__all__ = [
    "DEFAULT_HOST_RATIO",
    "POOL_CLASSES",
    "HostKVPool",
    "HostLayout",
    "HostPoolGroup",
    "KVSpec",
    "LayerMapper",
    "LayerRoute",
    "MHAHostPool",
    "MLAHostPool",
    "PageAllocator",
    "PoolEntry",
    "PoolKind",
    "PoolTransfer",
    "Reclaimer",
    "ResolveResult",
    "SharedSegment",
    "create_host_pool",
    "host_pages_for",
    "identity_layers",
    "layer_map",
    "layer_range",
    "open_host_pool",
    "pin_host_memory",
]
