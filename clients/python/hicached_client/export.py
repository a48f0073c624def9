"""Helpers for a worker to export its KV buffers to the daemon.

A worker exports each KV buffer once, at attach time, as a ``DeviceBuffer`` wire
message: a byte range of a sealed memfd for CPU workers (:class:`ShmKVPool`,
:func:`export_fd_tensor`; the client's attach hands the fd over with SCM_RIGHTS)
or a CUDA IPC memory handle on NVIDIA GPUs (:func:`export_cuda_ipc`). Memory is
never named: the daemon refuses /dev/shm names. The worker keeps owning the
memory: it must keep the exported tensors alive for as long as its session with
the daemon lasts.

Needs torch (the ``torch`` extra); CUDA is only touched by :func:`export_cuda_ipc`.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import math
import mmap
import os
import warnings

import torch

from hicached_client import _handoff
from hicached_client.v1 import types_pb2

# Buffers start on OS-page boundaries inside a ShmKVPool memfd; the daemon
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


def export_fd_tensor(fd: int, base_offset: int, tensor: torch.Tensor) -> types_pb2.DeviceBuffer:
    """Describe a contiguous CPU tensor that lives in the memory behind ``fd`` (a sealed memfd).

    ``base_offset`` is the byte offset in the fd's memory where the tensor's storage
    begins (the tensor's own storage offset is added). The returned handle's
    ``fd_index`` holds the LOCAL fd number: ``attach`` hands the fd over and
    renumbers it to its position in the handoff (the wire meaning). Keep ``fd`` open
    until the attach returned; attach refuses it (``ValueError``) once it is closed or
    refers to other memory.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"only contiguous CPU tensors can be exported by fd, got {tensor.device}")
    if base_offset < 0:
        raise ValueError(f"base_offset must be >= 0, got {base_offset}")
    if fd < 0:
        raise ValueError(f"invalid file descriptor {fd}")
    try:
        _handoff.record_export(fd)  # attach refuses the fd once it is no longer this memory
    except OSError as exc:
        raise ValueError(f"fd {fd} is not open: {exc}") from None
    offset = base_offset + int(tensor.storage_offset()) * tensor.element_size()
    return types_pb2.DeviceBuffer(
        handle=types_pb2.DeviceHandle(
            fd=types_pb2.FdHandle(fd_index=fd, offset=offset, size=tensor.numel() * tensor.element_size())
        ),
        shape=list(tensor.shape),
        dtype=dtype_to_wire(tensor.dtype),
    )


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of ``size`` bytes (memory reserved), sealed so its size can never change.

    The daemon maps only memfds sealed with ``F_SEAL_SHRINK``: a mapping whose file can
    shrink would SIGBUS it. ``name`` is only a label (``/proc/PID/fd``); nothing can open
    the memory by name. The caller owns (and closes) the returned fd.
    """
    if size <= 0:
        raise ValueError(f"memfd size must be > 0, got {size}")
    fd = os.memfd_create(name or "hicached", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        _handoff.record_export(fd)  # new memory at this number: a closed pool's record goes
    except BaseException:
        os.close(fd)
        raise
    return fd


class ShmKVPool:
    """A CPU worker's "device" KV pool living in one sealed memfd owned by the worker.

    Layer ``i``'s K (and V, unless ``mla``) is a (tokens, heads, head_dim) tensor at
    a page-aligned offset. The memory has no name in ``/dev/shm``: it is handed to the
    daemon as a file descriptor at attach (see :meth:`k_buffers`) and freed when the
    last process holding it (this pool, the daemon's mapping) lets go, so no crash can
    leave it behind. ``name`` is a label only. :meth:`close` unmaps (once the last view
    is gone) and closes the fd; idempotent. Not thread-safe for close; the tensors may
    be used from any thread.
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
            raise ValueError(f"invalid pool name {name!r}")
        dtype_to_wire(dtype)
        self.name = name
        self.shape = (tokens, heads, head_dim)
        self.dtype = dtype
        buf_bytes = tokens * heads * head_dim * dtype.itemsize
        self._stride = math.ceil(buf_bytes / _ALIGN) * _ALIGN
        num_bufs = num_layers * (1 if mla else 2)
        size = self._stride * num_bufs
        fd = sealed_memfd(name, size)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
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

    @property
    def fd(self) -> int:
        """The memfd holding the pool (owned by this pool; closed by :meth:`close`)."""
        if self._fd is None:
            raise ValueError(f"ShmKVPool {self.name!r} is closed")
        return self._fd

    def _export(self, tensors: list[torch.Tensor], offsets: list[int]) -> list[types_pb2.DeviceBuffer]:
        if self._mmap is None:
            raise ValueError(f"ShmKVPool {self.name!r} is closed")
        return [export_fd_tensor(self.fd, off, t) for t, off in zip(tensors, offsets, strict=True)]

    def k_buffers(self) -> list[types_pb2.DeviceBuffer]:
        return self._export(self.k, self._k_offsets)

    def v_buffers(self) -> list[types_pb2.DeviceBuffer]:
        return self._export(self.v, self._v_offsets)

    def close(self) -> None:
        """Drop this pool's views, mapping and fd (unmapping deferred while the caller holds views)."""
        mm, self._mmap = self._mmap, None
        fd, self._fd = self._fd, None
        self.k, self.v = [], []
        if mm is not None:
            with contextlib.suppress(BufferError):  # unmapped when the last view dies
                mm.close()
        if fd is not None:
            _handoff.forget_export(fd)  # specs naming it are refused from now on
            os.close(fd)

    def unlink(self) -> None:
        """Nothing to do: a memfd has no name (kept so callers of the named-segment pool still work)."""

    def __enter__(self) -> ShmKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
