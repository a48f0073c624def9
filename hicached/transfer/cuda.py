"""The CUDA side of the data plane: IPC memory handles, IPC event fences, D2H/H2D routes.

Imported lazily (by the handle registry and the copy router) the first time a CUDA
handle or tensor is seen, never on CPU machines. IPC allocations are opened with
the driver API (``libcuda.so.1``, stable across CUDA versions) on the daemon's own
context; copies run on one daemon-owned stream per device and copy thread.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hicached.errors import FailedPrecondition, InvalidArgument, NotFound, clip
from hicached.transfer.handles import (
    CUDA_IPC_HANDLE_BYTES,
    CudaIpcBufferHandle,
    Medium,
    OpenedAllocation,
)
from hicached.transfer.plan import PageCopy
from hicached.transfer.routes import (
    CopyContext,
    Staging,
    check_bounds,
    register_route,
    scatter_rows,
)
from hicached.transfer.runs import few_runs
from hicached.transfer.words import matched_rows

_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_CUDA_ERROR_INVALID_VALUE = 1
_CUDA_ERROR_INVALID_HANDLE = 400


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * CUDA_IPC_HANDLE_BYTES)]


class _Driver:
    """The few driver entry points torch does not expose."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._lib = lib
        self.open_mem = lib.cuIpcOpenMemHandle_v2
        self.open_mem.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcMemHandle, ctypes.c_uint]
        self.close_mem = lib.cuIpcCloseMemHandle
        self.close_mem.argtypes = [ctypes.c_uint64]
        self.address_range = lib.cuMemGetAddressRange_v2
        self.address_range.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        self._error_string = lib.cuGetErrorString
        self._error_string.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        msg = ctypes.c_char_p()
        self._error_string(rc, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else f"CUresult {rc}"
        if rc in (_CUDA_ERROR_INVALID_VALUE, _CUDA_ERROR_INVALID_HANDLE):
            raise NotFound(f"{what}: {text} (the exporting process may have exited)")
        raise FailedPrecondition(f"{what}: {text}")


@functools.cache
def _drv() -> _Driver:
    return _Driver()


def _norm_uuid(uuid: str) -> str:
    text = uuid.strip().lower()
    return text.removeprefix("gpu-")


def resolve_device(device_id: int, device_uuid: str = "") -> int:
    """The local ordinal of the worker's device (by UUID when given)."""
    if not torch.cuda.is_available():
        raise FailedPrecondition("a CUDA buffer handle was given but this daemon has no CUDA device")
    count = torch.cuda.device_count()
    if device_uuid:
        want = _norm_uuid(device_uuid)
        for ordinal in range(count):
            if _norm_uuid(str(torch.cuda.get_device_properties(ordinal).uuid)) == want:
                return ordinal
        raise NotFound(f"no local CUDA device has uuid {clip(device_uuid)}")
    if not 0 <= device_id < count:
        raise InvalidArgument(f"CUDA device id {device_id} is out of range [0, {count})")
    return device_id


class CudaBytes:
    """Exposes raw device bytes through ``__cuda_array_interface__``; keeps its allocation alive."""

    def __init__(self, owner: OpenedAllocation, ptr: int, nbytes: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # no implicit sync: the daemon orders copies with its own fences
        }


def device_view(
    owner: OpenedAllocation, device: int, ptr: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor over device memory at ``ptr`` that keeps ``owner`` alive while it is used."""
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.as_tensor(CudaBytes(owner, ptr, nbytes), device=f"cuda:{device}")
    return raw.view(dtype).view(shape)


class IpcAllocation(OpenedAllocation):
    """A worker's CUDA allocation mapped into the daemon; unmapped once by close()."""

    def __init__(self, device: int, handle: bytes) -> None:
        drv = _drv()
        self.device = device
        ptr = ctypes.c_uint64()
        base = ctypes.c_uint64()
        size = ctypes.c_size_t()
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # makes the primary context current on this thread
            drv.check(
                drv.open_mem(
                    ctypes.byref(ptr),
                    _IpcMemHandle.from_buffer_copy(handle),
                    _LAZY_PEER_ACCESS,
                ),
                f"cuIpcOpenMemHandle on device {device}",
            )
            rc = drv.address_range(ctypes.byref(base), ctypes.byref(size), ptr.value)
            if rc != 0:
                drv.close_mem(ptr.value)
                drv.check(rc, "cuMemGetAddressRange")
        self._ptr: int | None = int(ptr.value)
        self._size = int(size.value) - (int(ptr.value) - int(base.value))
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if self._ptr is None:
            raise FailedPrecondition("CUDA IPC allocation is closed")
        return device_view(self, self.device, self._ptr + offset, dtype, shape)

    def close(self) -> None:
        with self._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is None:
            return
        drv = _drv()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # no copy of ours may still read or write it
            drv.check(drv.close_mem(ptr), "cuIpcCloseMemHandle")


def open_ipc_allocation(handle: CudaIpcBufferHandle) -> IpcAllocation:
    return IpcAllocation(resolve_device(handle.device_id, handle.device_uuid), handle.handle)


def ipc_event_fence(event_handle: bytes, device_id: int, device_uuid: str = "") -> Callable[[], None]:
    """A callable that blocks until the worker's IPC event (its "ready" fence) has completed."""
    device = resolve_device(device_id, device_uuid)
    event = torch.cuda.Event.from_ipc_handle(device, event_handle)  # type: ignore[no-untyped-call]

    def wait() -> None:
        event.synchronize()

    return wait


@dataclass
class _CudaState:
    """Per copy thread: one stream per device and a pinned staging buffer."""

    streams: dict[int, torch.cuda.Stream] = field(default_factory=dict)
    pinned: Staging | None = None

    def stream(self, device: int) -> torch.cuda.Stream:
        s = self.streams.get(device)
        if s is None:
            s = self.streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return s

    def host_rows(self, n: int, like: torch.Tensor) -> torch.Tensor:
        if self.pinned is None:
            self.pinned = Staging(pin=True)
        return self.pinned.rows(n, like)

    def close(self) -> None:
        for s in self.streams.values():
            s.synchronize()
        self.streams.clear()
        self.pinned = None


def _state(ctx: CopyContext) -> _CudaState:
    state = ctx.resources.get(__name__)
    if not isinstance(state, _CudaState):
        state = _CudaState()
        ctx.resources[__name__] = state
    return state


def copy_with_cuda(copy: PageCopy, ctx: CopyContext) -> None:
    """D2H or H2D of pages: slice copies for runs, else gather -> one transfer -> scatter.

    Runs on the daemon's stream of the CUDA side's device; the stream is
    synchronised before the step is reported (deferred to the step's end), and
    right away when the pinned staging buffer has to be reused.
    """
    cuda_side = copy.src if copy.src.is_cuda else copy.dst
    device = int(cuda_side.device.index or 0)
    state = _state(ctx)
    stream = state.stream(device)
    src, dst = matched_rows(copy.src, copy.dst)
    sp, dp = copy.src_pages, copy.dst_pages
    n = len(sp)
    if n == 0:
        return
    check_bounds("source", sp, src.shape[0])
    check_bounds("destination", dp, dst.shape[0])
    with torch.cuda.device(device), torch.cuda.stream(stream):
        both = few_runs(sp, dp, n=n)
        if both is not None:
            for r in both:
                dst[r.dst : r.dst + r.count].copy_(src[r.src : r.src + r.count], non_blocking=True)
        elif src.is_cuda:  # D2H: gather on the GPU, one transfer, scatter on the CPU
            gathered = torch.index_select(src, 0, torch.from_numpy(sp).to(src.device, non_blocking=True))
            host = state.host_rows(n, src)
            host.copy_(gathered, non_blocking=True)
            stream.synchronize()
            scatter_rows(dst, dp, host, ctx)
        else:  # H2D: gather on the CPU into pinned memory, one transfer, scatter on the GPU
            host = state.host_rows(n, src)
            torch.index_select(src, 0, torch.from_numpy(sp), out=host)
            staged = host.to(dst.device, non_blocking=True)
            dst.index_copy_(0, torch.from_numpy(dp).to(dst.device, non_blocking=True), staged)
            stream.synchronize()  # the pinned buffer is reused by the next copy
    ctx.defer(stream.synchronize)


register_route(Medium.CUDA, Medium.CPU, copy_with_cuda)
register_route(Medium.CPU, Medium.CUDA, copy_with_cuda)
