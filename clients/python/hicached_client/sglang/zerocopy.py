"""Zero-copy: the daemon maps SGLang's host pool itself (``shm`` host allocator).

With SGLang's ``shm`` host allocator the host pool lives in one memfd. When that
memfd is sealed against shrinking (``F_SEAL_SHRINK``, which the daemon requires
before it maps a client's memory), the adapter hands the fd to the daemon once,
at attach, describing each plane of the pool as a "device" buffer; PutPages /
GetPages then name host-pool page numbers and the daemon copies between the
pool and its L2/L3. No page is copied in SGLang's process and no staging area
exists.

Conditions (checked once, at register time; any miss falls back to staging, and
the reason is logged):

* layout ``page_first`` (MHA or MLA): a plane's token rows hold every layer
  contiguously, which is the byte order of a staged chunk, so pages stored by
  either path are identical and instances on different paths share them;
* the pool's allocator is SGLang's ``ShmHostTensorAllocator`` with a live fd;
* the fd carries ``F_SEAL_SHRINK``. SGLang 0.5.23's ``alloc_shm`` creates its
  memfd without ``MFD_ALLOW_SEALING``, so its memfd can never be sealed:
  :func:`install_sealed_shm` replaces ``alloc_shm`` with one that creates the
  memfd sealable and seals it (size fixed) right after sizing it. It must run in
  the scheduler process before the host pool is allocated (docs/sglang.md).

Thread-safety: the functions are pure apart from :func:`install_sealed_shm`,
which patches a module attribute (idempotent). Ownership: SGLang owns the pool
and its fd; the daemon receives its own duplicate through the fd handoff.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import math
import mmap
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from hicached_client.export import export_fd_tensor
from hicached_client.sglang.layouts import PoolBinding
from hicached_client.v1 import types_pb2

log = logging.getLogger(__name__)

ZERO_COPY_LAYOUTS = frozenset({"page_first"})


@dataclass(frozen=True)
class ZeroCopyPlan:
    """The buffers to attach with (``reason`` says why not when ``k_buffers`` is empty)."""

    k_buffers: list[types_pb2.DeviceBuffer]
    v_buffers: list[types_pb2.DeviceBuffer]
    reason: str

    @property
    def ok(self) -> bool:
        return bool(self.k_buffers)


def _refuse(reason: str) -> ZeroCopyPlan:
    return ZeroCopyPlan([], [], reason)


def _mapping_base(mm: mmap.mmap) -> int:
    """The address where ``mm`` starts in this process."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def is_sealed(fd: int) -> bool:
    """Whether ``fd`` is a memfd sealed against shrinking (what the daemon requires)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return bool(seals & fcntl.F_SEAL_SHRINK)


def plan(host_pool: Any, binding: PoolBinding) -> ZeroCopyPlan:
    """The daemon buffers for ``host_pool`` itself, or why it cannot be mapped."""
    layout = str(getattr(host_pool, "layout", ""))
    if layout not in ZERO_COPY_LAYOUTS:
        return _refuse(f"host pool layout {layout!r} is not page_first")
    allocator = getattr(host_pool, "allocator", None)
    fd = getattr(allocator, "fd", None)
    mm = getattr(allocator, "mm", None)
    if not isinstance(fd, int) or not isinstance(mm, mmap.mmap):
        return _refuse(f"host allocator {type(allocator).__name__} is not SGLang's shm allocator")
    if len(getattr(allocator, "fds", [fd])) != 1:
        return _refuse("the shm allocator holds more than one memfd")
    if not is_sealed(fd):
        return _refuse(
            "the host pool memfd is not sealed (SGLang creates it without MFD_ALLOW_SEALING; "
            "call hicached_client.sglang.zerocopy.install_sealed_shm() before the pool is allocated)"
        )
    buf: torch.Tensor = host_pool.kv_buffer
    if not buf.is_contiguous():
        return _refuse("kv_buffer is not contiguous")
    g = binding.geometry
    base = _mapping_base(mm)
    offset = buf.data_ptr() - base
    nbytes = buf.numel() * buf.element_size()
    if offset < 0 or offset + nbytes > os.fstat(fd).st_size:
        return _refuse("kv_buffer does not lie inside the allocator's memfd")
    planes = buf.view(torch.uint8).reshape(g.groups, -1)
    rows = planes.shape[1] // (g.head_dim * g.dtype.itemsize)
    bufs = [
        export_fd_tensor(fd, offset, planes[p].view(g.dtype).view(rows, g.heads, g.head_dim))
        for p in range(g.groups)
    ]
    return ZeroCopyPlan(bufs[: g.num_layers], bufs[g.num_layers :], "")


def sealed_alloc_shm(dims: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int, mmap.mmap]:
    """SGLang's ``alloc_shm`` contract (tensor, fd, mm) over a memfd sealed at its size."""
    n_bytes = math.prod(dims) * torch.empty([], dtype=dtype).element_size()
    alloc_bytes = -(-n_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    fd = os.memfd_create(f"sglang_host_pool_{uuid.uuid4().hex}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, alloc_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, alloc_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mm, dtype=dtype, count=math.prod(dims)).reshape(dims)
    return tensor, fd, mm


def install_sealed_shm() -> None:
    """Make SGLang's ``shm`` host allocator create sealed memfds (idempotent).

    ``ShmHostTensorAllocator.allocate`` imports ``alloc_shm`` from
    ``sglang.srt.mem_cache.storage.mmap`` at each call, so patching that module
    attribute takes effect for every pool allocated afterwards in this process.
    """
    import sglang.srt.mem_cache.storage.mmap as sgl_mmap  # type: ignore[import-untyped]

    if sgl_mmap.alloc_shm is not sealed_alloc_shm:
        sgl_mmap.alloc_shm = sealed_alloc_shm
        log.info("hicached: SGLang's shm host allocator now creates sealed memfds (zero-copy capable)")
