"""Helpers for a worker to export its KV buffers to the daemon.

A worker exports each KV buffer once, at attach time, as a ``DeviceBuffer`` wire
message: a POSIX shared-memory range for CPU workers (:class:`ShmKVPool`,
:func:`export_shm_tensor`) or a CUDA IPC memory handle on NVIDIA GPUs
(:func:`export_cuda_ipc`). The worker keeps owning the memory: it must keep the
exported tensors alive (and the shm segment linked) for as long as its session
with the daemon lasts.

Needs torch (the ``torch`` extra); CUDA is only touched by :func:`export_cuda_ipc`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import os
import warnings

import torch

from hicached_client.v1 import types_pb2

SHM_DIR = "/dev/shm"
# Buffers start on OS-page boundaries inside a ShmKVPool segment; the daemon
# requires at least 16-byte alignment.
_ALIGN = 4096
_IPC_HANDLE_BYTES = 64

_WIRE_BY_DTYPE: dict[torch.dtype, types_pb2.DataType] = {
    torch.float16: types_pb2.DATA_TYPE_FLOAT16,
    torch.bfloat16: types_pb2.DATA_TYPE_BFLOAT16,
    torch.float32: types_pb2.DATA_TYPE_FLOAT32,
    torch.float8_e4m3fn: types_pb2.DATA_TYPE_FLOAT8_E4M3FN,
    torch.float8_e5m2: types_pb2.DATA_TYPE_FLOAT8_E5M2,
    torch.uint8: types_pb2.DATA_TYPE_UINT8,
    torch.int8: types_pb2.DATA_TYPE_INT8,
}
_DTYPE_BY_WIRE: dict[int, torch.dtype] = {v: k for k, v in _WIRE_BY_DTYPE.items()}


def dtype_to_wire(dtype: torch.dtype) -> types_pb2.DataType:
    """The ``DataType`` enum value of a torch dtype (ValueError for unsupported ones)."""
    try:
        return _WIRE_BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be sent to hicached") from None


def dtype_from_wire(value: int) -> torch.dtype:
    """The torch dtype of a ``DataType`` enum value (ValueError for unknown values)."""
    try:
        return _DTYPE_BY_WIRE[value]
    except KeyError:
        raise ValueError(f"unknown wire DataType {value}") from None


def export_shm_tensor(segment_name: str, base_offset: int, tensor: torch.Tensor) -> types_pb2.DeviceBuffer:
    """Describe a contiguous CPU tensor that lives in shm segment ``segment_name``.

    ``base_offset`` is the byte offset in the segment where the tensor's storage
    begins (the tensor's own storage offset is added).
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"only contiguous CPU tensors can be exported as shm, got {tensor.device}")
    if base_offset < 0:
        raise ValueError(f"base_offset must be >= 0, got {base_offset}")
    offset = base_offset + int(tensor.storage_offset()) * tensor.element_size()
    return types_pb2.DeviceBuffer(
        handle=types_pb2.DeviceHandle(
            shm=types_pb2.ShmHandle(
                name=segment_name, offset=offset, size=tensor.numel() * tensor.element_size()
            )
        ),
        shape=list(tensor.shape),
        dtype=dtype_to_wire(tensor.dtype),
    )


class ShmKVPool:
    """A CPU worker's "device" KV pool living in one POSIX shm segment owned by the worker.

    Layer ``i``'s K (and V, unless ``mla``) is a (tokens, heads, head_dim) tensor at
    a page-aligned offset. The segment is created here and never registered with a
    resource tracker: it lives until :meth:`unlink`, whatever happens to this
    process. :meth:`close` unmaps (once the last view is gone); both are idempotent.
    Not thread-safe for close/unlink; the tensors may be used from any thread.
    """

    def __init__(
        self,
        name: str,
        *,
        num_layers: int,
        tokens: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        mla: bool = False,
    ) -> None:
        for field, value in (
            ("num_layers", num_layers),
            ("tokens", tokens),
            ("heads", heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ShmKVPool {field} must be a positive int, got {value!r}")
        if not name or "/" in name:
            raise ValueError(f"invalid shm segment name {name!r}")
        dtype_to_wire(dtype)
        self.name = name
        self.shape = (tokens, heads, head_dim)
        self.dtype = dtype
        buf_bytes = tokens * heads * head_dim * dtype.itemsize
        self._stride = math.ceil(buf_bytes / _ALIGN) * _ALIGN
        num_bufs = num_layers * (1 if mla else 2)
        size = self._stride * num_bufs
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self._mmap: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.size = size
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._k_offsets: list[int] = []
        self._v_offsets: list[int] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns about mmap-backed buffers
            for i in range(num_bufs):
                offset = i * self._stride
                t = torch.frombuffer(
                    self._mmap, dtype=dtype, count=buf_bytes // dtype.itemsize, offset=offset
                )
                is_k = mla or i % 2 == 0
                (self.k if is_k else self.v).append(t.view(self.shape))
                (self._k_offsets if is_k else self._v_offsets).append(offset)

    def _export(self, tensors: list[torch.Tensor], offsets: list[int]) -> list[types_pb2.DeviceBuffer]:
        if self._mmap is None:
            raise ValueError(f"ShmKVPool {self.name!r} is closed")
        return [export_shm_tensor(self.name, off, t) for t, off in zip(tensors, offsets, strict=True)]

    def k_buffers(self) -> list[types_pb2.DeviceBuffer]:
        return self._export(self.k, self._k_offsets)

    def v_buffers(self) -> list[types_pb2.DeviceBuffer]:
        return self._export(self.v, self._v_offsets)

    def close(self) -> None:
        """Drop this pool's views and mapping (deferred while the caller still holds views)."""
        mm, self._mmap = self._mmap, None
        self.k, self.v = [], []
        if mm is not None:
            with contextlib.suppress(BufferError):  # unmapped when the last view dies
                mm.close()

    def unlink(self) -> None:
        """Remove the segment name; the daemon's existing mapping stays valid."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))

    def __enter__(self) -> ShmKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.unlink()


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_uint64]
    return lib


def export_cuda_ipc(tensor: torch.Tensor) -> types_pb2.DeviceBuffer:
    """Describe a contiguous CUDA tensor by the IPC handle of its allocation plus an offset.

    The worker must keep ``tensor`` (and so its allocation) alive while the daemon
    holds the handle. Allocations from expandable segments cannot be exported.
    """
    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise ValueError(f"only contiguous CUDA tensors can be exported over IPC, got {tensor.device}")
    lib = _libcuda()
    device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    handle = _IpcMemHandle()
    with torch.cuda.device(device):
        rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), tensor.data_ptr())
        if rc != 0:
            raise RuntimeError(f"cuMemGetAddressRange failed with CUresult {rc}")
        rc = lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value)
        if rc != 0:
            raise RuntimeError(f"cuIpcGetMemHandle failed with CUresult {rc}")
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return types_pb2.DeviceBuffer(
        handle=types_pb2.DeviceHandle(
            cuda_ipc=types_pb2.CudaIpcHandle(
                handle=bytes(handle),  # all 64 bytes (the field accessor would stop at a NUL)
                device_id=device,
                offset=tensor.data_ptr() - base.value,
                size=tensor.numel() * tensor.element_size(),
                device_uuid=uuid,
            )
        ),
        shape=list(tensor.shape),
        dtype=dtype_to_wire(tensor.dtype),
    )
