"""CUDA KV memory a worker can hand the daemon as a file descriptor (NVIDIA GPUs).

The preferred way to share GPU memory with the daemon: allocate the KV buffers
with :class:`CudaFdAllocation` (``cuMemCreate`` requesting a POSIX-fd shareable
handle), view them as tensors, and export each with :meth:`CudaFdAllocation.export`.
The client hands the fd over the daemon's handoff socket at attach (like a
memfd; see :mod:`hicached_client._handoff`), so nothing is named and the daemon's
import holds its own reference. Where the device cannot export POSIX fds
(:func:`posix_fd_supported` is False), fall back to
:func:`hicached_client.export.export_cuda_ipc` on ordinary torch tensors.

The driver bindings here are also used by the daemon to import the fd
(``hicached.transfer.cuda_vmm``), so both sides share one definition of the
driver structures. Needs ``libcuda.so.1``; nothing is loaded until used.

Thread-safety: an allocation may be viewed from any thread; close() once, after
the daemon session that uses it has detached.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

from hicached_client import _handoff
from hicached_client.export import dtype_to_wire
from hicached_client.v1 import types_pb2

POSIX_FD_HANDLE = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
ACCESS_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
ATTR_POSIX_FD_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
GRANULARITY_MINIMUM = 0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemAccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class MemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class VmmDriver:
    """The driver's virtual-memory entry points; each returns a CUresult (0 = success)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t, ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER

        def fn(name: str, *argtypes: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes = list(argtypes)
            f.restype = ctypes.c_int
            return f

        self.attribute = fn("cuDeviceGetAttribute", ptr(ctypes.c_int), ctypes.c_int, ctypes.c_int)
        self.granularity = fn(
            "cuMemGetAllocationGranularity", ptr(size_t), ptr(MemAllocationProp), ctypes.c_int
        )
        self.create = fn("cuMemCreate", ptr(u64), size_t, ptr(MemAllocationProp), u64)
        self.export = fn("cuMemExportToShareableHandle", ctypes.c_void_p, u64, ctypes.c_int, u64)
        self.import_handle = fn("cuMemImportFromShareableHandle", ptr(u64), ctypes.c_void_p, ctypes.c_int)
        self.reserve = fn("cuMemAddressReserve", ptr(u64), size_t, size_t, u64, u64)
        self.map = fn("cuMemMap", u64, size_t, size_t, u64, u64)
        self.set_access = fn("cuMemSetAccess", u64, size_t, ptr(MemAccessDesc), size_t)
        self.unmap = fn("cuMemUnmap", u64, size_t)
        self.address_free = fn("cuMemAddressFree", u64, size_t)
        self.release = fn("cuMemRelease", u64)
        self._error_string = fn("cuGetErrorString", ctypes.c_int, ptr(ctypes.c_char_p))

    def error_text(self, rc: int) -> str:
        msg = ctypes.c_char_p()
        self._error_string(rc, ctypes.byref(msg))
        return msg.value.decode() if msg.value else f"CUresult {rc}"

    def ok(self, rc: int, what: str) -> None:
        """Raise RuntimeError naming the call when ``rc`` is not success (client side)."""
        if rc != 0:
            raise RuntimeError(f"{what}: {self.error_text(rc)}")


@functools.cache
def driver() -> VmmDriver:
    return VmmDriver()


def _device(device: int | None) -> int:
    current = torch.cuda.current_device()  # also initialises CUDA (cuInit) for the driver calls
    return current if device is None else device


def posix_fd_supported(device: int | None = None) -> bool:
    """Whether ``device`` can export cuMem allocations as POSIX fds (else use CUDA IPC)."""
    drv, value = driver(), ctypes.c_int()
    rc = drv.attribute(ctypes.byref(value), ATTR_POSIX_FD_SUPPORTED, _device(device))
    return rc == 0 and value.value == 1


class _Bytes:
    def __init__(self, owner: CudaFdAllocation, ptr: int, nbytes: int) -> None:
        self.owner = owner  # keeps the allocation alive while a tensor views it
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class CudaFdAllocation:
    """``nbytes`` (rounded up to the granularity) of device memory exportable as a POSIX fd.

    The allocation owns its fd and its mapping; :meth:`close` releases both once.
    """

    def __init__(self, nbytes: int, device: int | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        drv = driver()
        self.device = _device(device)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # the primary context is current from here
            prop = MemAllocationProp(
                ALLOCATION_PINNED, POSIX_FD_HANDLE, MemLocation(LOCATION_DEVICE, self.device)
            )
            gran = ctypes.c_size_t()
            drv.ok(
                drv.granularity(ctypes.byref(gran), ctypes.byref(prop), GRANULARITY_MINIMUM), "granularity"
            )
            self.size = -(-nbytes // gran.value) * gran.value
            handle, ptr, fd = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int(-1)
            drv.ok(drv.create(ctypes.byref(handle), self.size, ctypes.byref(prop), 0), "cuMemCreate")
            try:
                drv.ok(
                    drv.export(ctypes.byref(fd), handle.value, POSIX_FD_HANDLE, 0),
                    "cuMemExportToShareableHandle",
                )
                drv.ok(drv.reserve(ctypes.byref(ptr), self.size, 0, 0, 0), "cuMemAddressReserve")
                drv.ok(drv.map(ptr.value, self.size, 0, handle.value, 0), "cuMemMap")
                access = MemAccessDesc(MemLocation(LOCATION_DEVICE, self.device), ACCESS_READ_WRITE)
                drv.ok(drv.set_access(ptr.value, self.size, ctypes.byref(access), 1), "cuMemSetAccess")
            except BaseException:
                if ptr.value:
                    drv.unmap(ptr.value, self.size)
                    drv.address_free(ptr.value, self.size)
                if fd.value >= 0:
                    os.close(fd.value)
                drv.release(handle.value)
                raise
        self._handle = int(handle.value)
        self.ptr = int(ptr.value)
        self.fd = int(fd.value)
        self.device_uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        self._closed = False

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A tensor over ``[offset, offset + prod(shape) * itemsize)`` of this allocation."""
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside the {self.size}-byte allocation")
        raw = torch.as_tensor(_Bytes(self, self.ptr + offset, nbytes), device=f"cuda:{self.device}")
        return raw.view(dtype).view(shape)

    def export(self, tensor: torch.Tensor) -> types_pb2.DeviceBuffer:
        """The wire description of ``tensor`` (a contiguous view of this allocation)."""
        start = tensor.data_ptr() - self.ptr
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_contiguous() or start < 0 or start + nbytes > self.size:
            raise ValueError("tensor is not a contiguous view of this allocation")
        _handoff.record_export(self.fd)  # attach refuses the number once this allocation closed it
        return types_pb2.DeviceBuffer(
            handle=types_pb2.DeviceHandle(
                cuda_fd=types_pb2.CudaFdHandle(
                    fd_index=self.fd,  # the local fd; the client renumbers it at attach
                    allocation_size=self.size,
                    offset=start,
                    size=nbytes,
                    device_id=self.device,
                    device_uuid=self.device_uuid,
                )
            ),
            shape=list(tensor.shape),
            dtype=dtype_to_wire(tensor.dtype),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        drv = driver()
        torch.cuda.synchronize(self.device)
        drv.unmap(self.ptr, self.size)
        drv.address_free(self.ptr, self.size)
        drv.release(self._handle)
        _handoff.forget_export(self.fd)  # specs still naming it are refused from now on
        os.close(self.fd)

    def __enter__(self) -> CudaFdAllocation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
