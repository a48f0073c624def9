"""Device-memory handles a worker exports, and the daemon-side mappings that open them.

A worker hands the daemon one handle per KV buffer at attach time (a byte range of
a file descriptor it handed over -- a sealed memfd -- on CPU workers; on NVIDIA
GPUs a ``cuMemCreate`` allocation exported as a POSIX fd, or a legacy CUDA IPC
memory handle where the fd form is unavailable). Memory is never named: the daemon opens no path a
client chose, so a client can only give it memory it already holds. The daemon opens
every allocation once per worker session through
:class:`~hicached.transfer.mappings.DeviceMappings` and from
then on only uses the tensor views it handed out. Openers sit in a registry keyed
by handle type, so callers never branch on the kind of handle.

Nothing here imports CUDA: the CUDA openers validate their handles on any
machine and load :mod:`hicached.transfer.cuda` / :mod:`hicached.transfer.cuda_vmm`
only when they actually map one.
"""

from __future__ import annotations

import abc
import enum
import errno
import fcntl
import math
import mmap
import os
import stat
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from hicached_client import vocab

from hicached.errors import InvalidArgument
from hicached.shm import TMPFS_MAGIC, SharedSegment, fs_type, map_file, populate_backed

# Every buffer must start on this byte boundary: the copy kernels view pages as
# 8/16-byte words to reach memcpy speed, which needs aligned starts.
BUFFER_ALIGNMENT = 16
CUDA_IPC_HANDLE_BYTES = 64

# Derived from the one dtype vocabulary (DataType values are torch's spellings).
DTYPE_BY_NAME: dict[str, torch.dtype] = {d.value: getattr(torch, d.value) for d in vocab.DataType}
NAME_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_BY_NAME.items()}


class Medium(enum.StrEnum):
    """Where a buffer lives; the values equal ``torch.device.type``."""

    CPU = "cpu"
    CUDA = "cuda"


_MEDIA = {m.value: m for m in Medium}  # a dict lookup: Medium(...) costs ~10x more per copy


def medium_of(tensor: torch.Tensor) -> Medium:
    """The medium of a tensor; InvalidArgument for devices the daemon cannot copy."""
    # Read per copy: the two flags cost ~70 ns each, ``tensor.device`` ~300 (a new object).
    if tensor.is_cpu:
        return Medium.CPU
    if tensor.is_cuda:
        return Medium.CUDA
    medium = _MEDIA.get(tensor.device.type)
    if medium is None:
        raise InvalidArgument(f"unsupported tensor device {tensor.device}")
    return medium


@dataclass(frozen=True)
class FdBufferHandle:
    """A byte range of memory behind a file descriptor the worker handed over.

    ``fd`` is the daemon's own descriptor (received with SCM_RIGHTS); the caller of
    :meth:`DeviceMappings.open_all` owns it and may close it once the attach is over
    (the mapping keeps the memory). ``index`` is its position in the handoff, for
    messages only.
    """

    fd: int
    offset: int
    size: int
    index: int = 0


@dataclass(frozen=True)
class CudaIpcBufferHandle:
    """A byte range of a CUDA allocation exported with ``cuIpcGetMemHandle``.

    ``handle`` is the 64-byte IPC handle of the whole allocation; ``offset`` is the
    buffer's start inside it. ``device_uuid`` (when set) wins over ``device_id``,
    because device ordinals differ between processes with different visibility.
    """

    handle: bytes
    device_id: int
    offset: int
    size: int
    device_uuid: str = ""


@dataclass(frozen=True)
class CudaFdBufferHandle:
    """A byte range of a ``cuMemCreate`` allocation handed over as a POSIX fd.

    ``fd`` is the daemon's own descriptor (received with SCM_RIGHTS; owned like
    :attr:`FdBufferHandle.fd`); ``allocation_size`` is the size the worker created,
    which the daemon maps whole. ``device_uuid`` (when set) wins over ``device_id``.
    """

    fd: int
    allocation_size: int
    offset: int
    size: int
    device_id: int
    device_uuid: str = ""
    index: int = 0


DeviceHandle = FdBufferHandle | CudaIpcBufferHandle | CudaFdBufferHandle


@dataclass(frozen=True)
class BufferSpec:
    """One exported buffer: where it is, and the tensor it holds."""

    handle: DeviceHandle
    shape: tuple[int, ...]
    dtype: torch.dtype


class OpenedAllocation(abc.ABC):
    """One mapped allocation (a handed-over memfd, an IPC allocation), or a span of one.

    Owned by the :class:`DeviceMappings` that opened it; closed exactly once by it.
    """

    @property
    def base(self) -> int:
        """Offset in the allocation of this mapping's first byte; 0 when mapped from the start."""
        return 0

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Bytes addressable through this mapping, from :attr:`base`."""

    @abc.abstractmethod
    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over ``[offset, offset + prod(shape) * itemsize)`` of this mapping (so
        ``offset`` counts from :attr:`base`); range already checked."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap; views taken before become invalid."""


H = TypeVar("H")


class HandleOpener(abc.ABC, Generic[H]):
    """Validates and maps one kind of handle. Stateless; shared by all sessions."""

    medium: Medium
    # True when open_span maps only the span asked for, so one allocation may be
    # mapped as several spans; False: open_span maps the whole allocation, and
    # DeviceMappings opens it at most once per session.
    maps_spans: bool = False

    def check(self, handle: H) -> None:
        """Kind-specific static checks (before anything is opened); no-op by default."""

    @abc.abstractmethod
    def key(self, handle: H) -> Hashable:
        """Identity of the allocation, so several buffers in it share one mapping."""

    @abc.abstractmethod
    def open(self, handle: H) -> OpenedAllocation:
        """Map the allocation; NotFound when it does not exist."""

    def open_span(self, handle: H, start: int, end: int) -> OpenedAllocation:
        """Map at least bytes ``[start, end)`` of the allocation ``handle`` names.

        The default maps the whole allocation: a device allocation's size is fixed by
        the driver, not by the client, so mapping all of it costs nothing a client chose.
        """
        return self.open(handle)


class FdOpener(HandleOpener[FdBufferHandle]):
    """Maps a memfd sealed against shrinking; refuses every other fd.

    Why only sealed memfds: a mapping of memory whose size can shrink under the
    daemon raises SIGBUS on the next copy and kills the process (every session
    lost). With ``F_SEAL_SHRINK`` the kernel refuses any ``ftruncate`` to a
    smaller size, so the mapped range stays backed for the life of the mapping
    (holes punched in it read back as zeros, never fault). Copying unsealed fds
    with ``preadv``/``pwritev`` instead would be SIGBUS-safe too, but halves the
    copy speed and keeps two data paths; a worker can always seal its own memfd.
    Only tmpfs memfds: a hugetlbfs one (``MFD_HUGETLB``) gives its pages and their
    reservation back on ``fallocate(PUNCH_HOLE)``, which the seal does not stop, and
    the daemon's next copy into them faults with SIGBUS once another file took them.
    """

    medium = Medium.CPU
    maps_spans = True

    def check(self, handle: FdBufferHandle) -> None:
        if type(handle.fd) is not int or handle.fd < 0:
            raise InvalidArgument(f"invalid file descriptor {handle.fd!r}")

    def key(self, handle: FdBufferHandle) -> Hashable:
        return ("fd", handle.fd)

    def open(self, handle: FdBufferHandle) -> OpenedAllocation:
        return self.open_span(handle, handle.offset, handle.offset + handle.size)

    def open_span(self, handle: FdBufferHandle, start: int, end: int) -> OpenedAllocation:
        """Map ``[start rounded down to the mmap granularity, end)`` of the memfd, never more.

        Why not the whole file: its size is the client's choice and costs it nothing (a
        sparse memfd ftruncated to 64 TiB holds no memory), while every byte mapped
        takes the daemon's address space -- 54 such attaches took it to 127 TiB, and
        then mmap and thread stacks failed for every client (ENOMEM).
        """
        what = f"handed-over fd #{handle.index}"
        try:
            seals = fcntl.fcntl(handle.fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise InvalidArgument(
                f"{what} is not a memfd ({exc.strerror}): hand over a memfd created with "
                "MFD_ALLOW_SEALING and sealed with F_SEAL_SHRINK"
            ) from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise InvalidArgument(
                f"{what} can still shrink: seal it with F_SEAL_SHRINK (memfd_create with "
                "MFD_ALLOW_SEALING, then fcntl(F_ADD_SEALS)) so that truncating it cannot crash the daemon"
            )
        try:
            fs = fs_type(handle.fd)
        except OSError as exc:
            raise InvalidArgument(f"{what}: cannot tell its file system ({exc.strerror})") from None
        if fs != TMPFS_MAGIC:
            raise InvalidArgument(
                f"{what} is not on tmpfs (file system 0x{fs:x}; hugetlbfs memfds, MFD_HUGETLB, can "
                "lose their pages under the seal): hand over a memfd created without MFD_HUGETLB"
            )
        st = os.fstat(handle.fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
            raise InvalidArgument(f"{what} is empty or not a memory file (size {st.st_size})")
        if not 0 <= start < end <= st.st_size:
            raise InvalidArgument(f"buffer [{start}, {end}) exceeds its allocation of {st.st_size} bytes")
        # mmap offsets must be multiples of the granularity; the views start at start - base.
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            mm = map_file(handle.fd, end - base, offset=base)  # holds no descriptor (see there)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise  # the daemon ran out (RESOURCE_EXHAUSTED), not the client's fault
            raise InvalidArgument(
                f"{what} cannot be mapped read-write ({exc.strerror}): send an O_RDWR memfd without "
                "F_SEAL_WRITE / F_SEAL_FUTURE_WRITE"
            ) from None
        populate_backed(mm, st)
        return _ShmAllocation(SharedSegment(f"fd#{handle.index}", mm, end - base, writable=True), base)


class _ShmAllocation(OpenedAllocation):
    """Bytes ``[base, base + segment.size)`` of a memfd; owns ``segment``."""

    def __init__(self, segment: _Segment, base: int = 0) -> None:
        self._segment = segment
        self._base = base

    @property
    def base(self) -> int:
        return self._base

    @property
    def size(self) -> int:
        return int(self._segment.size)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._segment.tensor(dtype, shape, offset)

    def close(self) -> None:
        self._segment.close()


class _Segment(Protocol):
    """The part of ``hicached.shm.SharedSegment`` used here."""

    @property
    def size(self) -> int: ...

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor: ...

    def close(self) -> None: ...


class CudaIpcOpener(HandleOpener[CudaIpcBufferHandle]):
    medium = Medium.CUDA

    def check(self, handle: CudaIpcBufferHandle) -> None:
        if not isinstance(handle.handle, bytes) or len(handle.handle) != CUDA_IPC_HANDLE_BYTES:
            got = len(handle.handle) if isinstance(handle.handle, bytes) else type(handle.handle).__name__
            raise InvalidArgument(f"CUDA IPC handle must be {CUDA_IPC_HANDLE_BYTES} bytes, got {got}")
        if handle.handle == bytes(CUDA_IPC_HANDLE_BYTES):
            raise InvalidArgument("CUDA IPC handle is all zero bytes")
        if not isinstance(handle.device_id, int) or handle.device_id < 0:
            raise InvalidArgument(f"invalid CUDA device id {handle.device_id!r}")

    def key(self, handle: CudaIpcBufferHandle) -> Hashable:
        return ("cuda_ipc", handle.device_uuid or handle.device_id, handle.handle)

    def open(self, handle: CudaIpcBufferHandle) -> OpenedAllocation:
        from hicached.transfer import cuda

        return cuda.open_ipc_allocation(handle)


class CudaFdOpener(HandleOpener[CudaFdBufferHandle]):
    """Imports a POSIX-fd shareable handle of a worker's ``cuMemCreate`` allocation.

    Why this over CUDA IPC: the daemon imports the allocation itself (no name to
    guess or replay), and the import holds a reference, so the worker freeing its
    memory cannot pull it from under an in-flight copy.
    """

    medium = Medium.CUDA

    def check(self, handle: CudaFdBufferHandle) -> None:
        if type(handle.fd) is not int or handle.fd < 0:
            raise InvalidArgument(f"invalid file descriptor {handle.fd!r}")
        if handle.allocation_size <= 0:
            raise InvalidArgument("CUDA fd handle: allocation_size must be the allocation's size (> 0)")
        if handle.offset + handle.size > handle.allocation_size:
            raise InvalidArgument(
                f"CUDA fd handle: buffer [{handle.offset}, {handle.offset + handle.size}) is beyond "
                f"the allocation's {handle.allocation_size} bytes"
            )
        if not isinstance(handle.device_id, int) or handle.device_id < 0:
            raise InvalidArgument(f"invalid CUDA device id {handle.device_id!r}")

    def key(self, handle: CudaFdBufferHandle) -> Hashable:
        return ("cuda_fd", handle.fd)

    def open(self, handle: CudaFdBufferHandle) -> OpenedAllocation:
        from hicached.transfer import cuda_vmm

        return cuda_vmm.open_fd_allocation(handle)


_OPENERS: dict[type, HandleOpener[Any]] = {
    FdBufferHandle: FdOpener(),
    CudaIpcBufferHandle: CudaIpcOpener(),
    CudaFdBufferHandle: CudaFdOpener(),
}


def register_opener(handle_type: type[H], opener: HandleOpener[H]) -> None:
    """Register (or replace) the opener of one handle type; new kinds plug in here."""
    _OPENERS[handle_type] = opener


def opener_for(handle: object) -> HandleOpener[Any]:
    """The registered opener of a handle's type; InvalidArgument for unknown kinds."""
    opener = _OPENERS.get(type(handle))
    if opener is None:
        raise InvalidArgument(f"unsupported device handle type {type(handle).__name__}")
    return opener


def cuda_ipc_event_fence(event_handle: bytes, device_id: int, device_uuid: str = "") -> Callable[[], None]:
    """The ``ready`` callable for a worker's IPC event fence: blocks until the event completed.

    Validates the handle on any machine; opening it needs CUDA (FailedPrecondition without).
    """
    if not isinstance(event_handle, bytes) or len(event_handle) != CUDA_IPC_HANDLE_BYTES:
        got = len(event_handle) if isinstance(event_handle, bytes) else type(event_handle).__name__
        raise InvalidArgument(f"CUDA IPC event handle must be {CUDA_IPC_HANDLE_BYTES} bytes, got {got}")
    from hicached.transfer import cuda

    return cuda.ipc_event_fence(event_handle, device_id, device_uuid)


def validate_spec(spec: BufferSpec) -> int:
    """Static checks of a buffer spec that need no mapping; returns its byte size.

    Raises InvalidArgument naming the offending value.
    """
    if not isinstance(spec.dtype, torch.dtype) or spec.dtype not in NAME_BY_DTYPE:
        raise InvalidArgument(f"unsupported buffer dtype {spec.dtype!r}")
    shape = spec.shape
    if not isinstance(shape, tuple) or not shape or not all(type(d) is int and d > 0 for d in shape):
        raise InvalidArgument(f"buffer shape must be a non-empty tuple of positive ints, got {shape!r}")
    handle = spec.handle
    opener = opener_for(handle)
    for field in ("offset", "size"):
        value = getattr(handle, field)
        if type(value) is not int or value < 0:
            raise InvalidArgument(f"buffer {field} must be a non-negative int, got {value!r}")
    itemsize = spec.dtype.itemsize
    expected = math.prod(shape) * itemsize
    if handle.size != expected:
        raise InvalidArgument(
            f"buffer size {handle.size} != prod(shape {shape}) * itemsize {itemsize} = {expected}"
        )
    if handle.offset % BUFFER_ALIGNMENT:
        raise InvalidArgument(f"buffer offset {handle.offset} is not a multiple of {BUFFER_ALIGNMENT} bytes")
    opener.check(handle)
    return expected
