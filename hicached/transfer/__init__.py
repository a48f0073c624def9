"""The data plane: device handles, copy planning and the node-wide copy engine.

The only package of the daemon that touches CUDA (lazily, in
:mod:`hicached.transfer.cuda`); it knows nothing of gRPC or of the wire format.
"""

from hicached.transfer.engine import CopyEngine, CopyResult, Priority
from hicached.transfer.handles import (
    DTYPE_BY_NAME,
    NAME_BY_DTYPE,
    BufferSpec,
    CudaFdBufferHandle,
    CudaIpcBufferHandle,
    FdBufferHandle,
    Medium,
    cuda_ipc_event_fence,
    medium_of,
)
from hicached.transfer.mappings import DeviceMappings
from hicached.transfer.plan import CopyPlan, DevicePoolView, Direction, LayerStep, PageCopy, build_plan

__all__ = [
    "DTYPE_BY_NAME",
    "NAME_BY_DTYPE",
    "BufferSpec",
    "CopyEngine",
    "CopyPlan",
    "CopyResult",
    "CudaFdBufferHandle",
    "CudaIpcBufferHandle",
    "DeviceMappings",
    "DevicePoolView",
    "Direction",
    "FdBufferHandle",
    "LayerStep",
    "Medium",
    "PageCopy",
    "Priority",
    "build_plan",
    "cuda_ipc_event_fence",
    "medium_of",
]
