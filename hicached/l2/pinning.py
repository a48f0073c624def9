"""Page-locking host memory for DMA, behind one function.

Only on CUDA machines: ``cudaHostRegister`` pins an existing mapping (our
shared-memory pool) in place, which is what lets a copy engine reach it at
PCIe speed. On the CPU-only build there is nothing to do (``torch.pin_memory``
raises there and ``mlock`` is capped at 8 MiB for non-root), so the caller gets
``None`` and carries on with pageable memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from hicached.errors import FailedPrecondition

logger = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_DEFAULT = 0


def pin_host_memory(t: torch.Tensor) -> Callable[[], None] | None:
    """Register ``t``'s memory as pinned; return the matching unregister callable.

    Returns None when CUDA is not available. The caller owns the registration:
    it must call the returned function exactly once before the memory is
    unmapped (the function is idempotent, so a second call is harmless).
    Raises FailedPrecondition when CUDA refuses the registration.
    """
    if not torch.cuda.is_available():
        return None
    if not t.is_contiguous():
        raise FailedPrecondition(f"cannot pin a non-contiguous tensor of shape {tuple(t.shape)}")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return None
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    ptr = t.data_ptr()
    rc = cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_DEFAULT)
    if int(rc) != 0:
        # int(): torch's enum prints codes it does not name (712, already registered) as '???'.
        raise FailedPrecondition(
            f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed with CUDA error {int(rc)}"
        )
    logger.info("pinned %d bytes of host memory at %#x", nbytes, ptr)
    done = False

    def unregister() -> None:
        nonlocal done
        if done:
            return
        done = True
        rc = cudart.cudaHostUnregister(ptr)
        if int(rc) != 0:
            logger.warning("cudaHostUnregister at %#x failed with CUDA error %d", ptr, int(rc))

    return unregister
