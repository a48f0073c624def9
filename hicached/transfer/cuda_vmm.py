"""Importing a worker's ``cuMemCreate`` allocation from a POSIX file descriptor.

The fd form of CUDA memory sharing (driver API "virtual memory management"):
the worker creates its KV memory with ``cuMemCreate`` requesting
``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, exports it with
``cuMemExportToShareableHandle`` and hands the fd over the handoff socket like a
memfd. Here the daemon imports it (``cuMemImportFromShareableHandle``), reserves
an address range, maps the whole allocation and grants its own device
read/write access. The import holds a reference of its own: the worker
releasing its handle does not free memory a copy may still touch.

Imported lazily by :class:`hicached.transfer.handles.CudaFdOpener`, never on CPU
machines. The driver bindings are the client's (:mod:`hicached_client.cuda_vmm`),
so both sides share one definition of the driver structures. Not run on our CI
machines (no GPU): covered by gpu-marked tests.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from hicached_client.cuda_vmm import (
    ACCESS_READ_WRITE,
    LOCATION_DEVICE,
    POSIX_FD_HANDLE,
    MemAccessDesc,
    MemLocation,
    driver,
)

from hicached.errors import FailedPrecondition, InvalidArgument
from hicached.transfer.cuda import device_view, resolve_device
from hicached.transfer.handles import CudaFdBufferHandle, OpenedAllocation

_CUDA_ERROR_INVALID_VALUE = 1
# What the driver answers when the fd is no cuMem export at all (a memfd, a file): seen on an
# H200 (driver 580) as CUDA_ERROR_UNKNOWN; the others are the documented refusals of a handle.
_NOT_AN_EXPORT = frozenset({1, 400, 999})  # INVALID_VALUE, INVALID_HANDLE, UNKNOWN


def _check(rc: int, what: str) -> None:
    if rc == 0:
        return
    text = f"{driver().error_text(rc)} (CUresult {rc})"
    if rc == _CUDA_ERROR_INVALID_VALUE:
        raise InvalidArgument(f"{what}: {text} (is allocation_size the size the worker created?)")
    raise FailedPrecondition(f"{what}: {text}")


def _import(handle: ctypes.c_uint64, fd: int) -> None:
    """The one step whose only input is the client's fd: its refusal is the client's error."""
    rc = driver().import_handle(ctypes.byref(handle), ctypes.c_void_p(fd), POSIX_FD_HANDLE)
    if rc in _NOT_AN_EXPORT:
        raise InvalidArgument(
            f"cuMemImportFromShareableHandle: {driver().error_text(rc)} (CUresult {rc}): the fd "
            "is not a CUDA allocation; export it with cuMemExportToShareableHandle and "
            "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (hicached_client.cuda_vmm.CudaFdAllocation does)"
        )
    _check(rc, "cuMemImportFromShareableHandle")


class FdAllocation(OpenedAllocation):
    """A worker's cuMem allocation imported and mapped into the daemon; unmapped once by close().

    Thread-safety: view() may be called from any thread; close() once, by the owning
    DeviceMappings, after the copies that used the views have finished.
    """

    def __init__(self, device: int, fd: int, size: int) -> None:
        drv = driver()
        self.device = device
        self._size = size
        handle, ptr = ctypes.c_uint64(), ctypes.c_uint64()
        undo: list[tuple[str, int]] = []  # rollback beside the steps it undoes
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # makes the primary context current on this thread
            try:
                _import(handle, fd)
                undo.append(("release", handle.value))
                _check(drv.reserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
                undo.append(("free", ptr.value))
                _check(drv.map(ptr.value, size, 0, handle.value, 0), "cuMemMap")
                undo.append(("unmap", ptr.value))
                access = MemAccessDesc(MemLocation(LOCATION_DEVICE, device), ACCESS_READ_WRITE)
                _check(drv.set_access(ptr.value, size, ctypes.byref(access), 1), "cuMemSetAccess")
            except BaseException:
                self._undo(undo)
                raise
        self._handle = int(handle.value)
        self._ptr: int | None = int(ptr.value)
        self._lock = threading.Lock()

    def _undo(self, steps: list[tuple[str, int]]) -> None:
        drv = driver()
        for step, value in reversed(steps):
            if step == "unmap":
                drv.unmap(value, self._size)
            elif step == "free":
                drv.address_free(value, self._size)
            else:
                drv.release(value)

    @property
    def size(self) -> int:
        return self._size

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if self._ptr is None:
            raise FailedPrecondition("CUDA fd allocation is closed")
        return device_view(self, self.device, self._ptr + offset, dtype, shape)

    def close(self) -> None:
        with self._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is None:
            return
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # no copy of ours may still read or write it
            self._undo([("release", self._handle), ("free", ptr), ("unmap", ptr)])


def open_fd_allocation(handle: CudaFdBufferHandle) -> FdAllocation:
    device = resolve_device(handle.device_id, handle.device_uuid)
    return FdAllocation(device, handle.fd, handle.allocation_size)
