"""CUDA KV memory handed to the daemon as a POSIX fd (needs a CUDA device; skipped elsewhere).

The worker (this process) allocates its K/V buffers with ``CudaFdAllocation``, attaches
over the real socket (the fd travels the handoff like a memfd), writes pages to the
daemon's host pool, clobbers its buffers, loads the pages back into other slots and
compares bytes.
"""

from __future__ import annotations

import pytest
import torch
from hicached_client import HiCacheClient, Transfer, WorkerIdentity, pool_spec

from tests.support.daemon import Daemon
from tests.support.kv import unique_tag

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE, HEADS, DIM, PAGES = 16, 4, 64, 32


def test_pages_round_trip_through_a_posix_fd_cuda_allocation(daemon: Daemon) -> None:
    from hicached_client.cuda_vmm import CudaFdAllocation, posix_fd_supported

    if not posix_fd_supported():
        pytest.fail("this CUDA device cannot export POSIX fds: the fd path cannot be tested here")
    shape = (PAGES * PAGE, HEADS, DIM)
    nbytes = PAGES * PAGE * HEADS * DIM * 2
    with CudaFdAllocation(2 * nbytes + 4096) as alloc:
        k = alloc.tensor(torch.float16, shape, offset=0)
        v = alloc.tensor(torch.float16, shape, offset=nbytes + 4096)  # a buffer inside the allocation
        gen = torch.Generator(device="cuda").manual_seed(7)
        for t in (k, v):
            t.view(torch.int16).copy_(
                torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device="cuda", generator=gen)
            )
        expect = [k[: 8 * PAGE].clone(), v[: 8 * PAGE].clone()]
        spec = pool_spec(
            "kv",
            role="anchor",
            kind="mha",
            dtype="float16",
            page_size=PAGE,
            num_layers=1,
            num_heads=HEADS,
            head_dim=DIM,
            k_buffers=[alloc.export(k)],
            v_buffers=[alloc.export(v)],
            host_ratio=1.0,
        )
        torch.cuda.synchronize()
        with HiCacheClient(daemon.target, timeout_s=30) as client:
            ident = WorkerIdentity(unique_tag("cudafd"), generation=1, model_name="m-cudafd")
            with client.attach(ident, [spec]) as session:
                written = session.write([Transfer("kv", list(range(8)))], allocate=True)
                host = list(written.transfers[0].host_pages)
                k.zero_()
                v.zero_()
                torch.cuda.synchronize()
                for _ in session.load([Transfer("kv", list(range(16, 24)), host)]):
                    pass
                torch.cuda.synchronize()
                # Bits, not values: random float16 bit patterns include NaNs, which never compare equal.
                assert torch.equal(k[16 * PAGE : 24 * PAGE].view(torch.int16), expect[0].view(torch.int16))
                assert torch.equal(v[16 * PAGE : 24 * PAGE].view(torch.int16), expect[1].view(torch.int16))
                assert not k[: 8 * PAGE].any(), "only the loaded slots were written"
