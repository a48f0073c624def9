"""The CUDA IPC data plane (run on a machine with a CUDA device; skipped elsewhere)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hicached_client.export import dtype_from_wire
from hicached_client.v1 import types_pb2

from hicached.l2.host_pool import HostKVPool
from hicached.transfer import (
    BufferSpec,
    CopyEngine,
    CudaIpcBufferHandle,
    DeviceMappings,
    DevicePoolView,
    Direction,
    Medium,
    Priority,
    build_plan,
)
from hicached.transfer.handles import cuda_ipc_event_fence
from hicached.transfer.plan import PageCopy
from hicached.transfer.routes import CopyContext, run_copy

from .conftest import PAGE, pages_of, spec_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKENS = 12 * PAGE
CHILD = textwrap.dedent(
    """
    import hashlib, sys, torch
    from hicached_client.export import export_cuda_ipc
    seed, tokens = int(sys.argv[1]), int(sys.argv[2])
    gen = torch.Generator().manual_seed(seed)
    # One allocation holding all four buffers, so offsets inside it are exercised too.
    block = torch.empty(4 * tokens * 2 * 8 + 64, dtype=torch.bfloat16, device="cuda:0")
    n = tokens * 2 * 8
    bufs = [block[64 + i * n : 64 + (i + 1) * n].view(tokens, 2, 8) for i in range(4)]
    for b in bufs:
        b.view(torch.int16).copy_(
            torch.randint(-2**15, 2**15, b.shape, dtype=torch.int16, generator=gen).cuda())
    ready = torch.cuda.Event(interprocess=True)
    ready.record()
    for kind, b in zip("kkvv", bufs):
        print(kind, export_cuda_ipc(b).SerializeToString().hex())
    print("event", bytes(ready.ipc_handle()).hex())
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "dump":
            torch.cuda.synchronize()
            for b in bufs:
                print(hashlib.sha256(b.view(torch.int16).cpu().numpy().tobytes()).hexdigest())
            print("end", flush=True)
        else:
            break
    """
)


def ipc_spec(buf: types_pb2.DeviceBuffer) -> BufferSpec:
    h = buf.handle.cuda_ipc
    return BufferSpec(
        CudaIpcBufferHandle(h.handle, h.device_id, h.offset, h.size, h.device_uuid),
        tuple(buf.shape),
        dtype_from_wire(buf.dtype),
    )


def expected_buffers(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-(2**15), 2**15, (TOKENS, 2, 8), dtype=torch.int16, generator=gen) for _ in range(4)
    ]


def test_cuda_ipc_export_open_d2h_h2d_byte_exact(make_host: Callable[..., HostKVPool]) -> None:
    seed = 11
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(seed), str(TOKENS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    mappings = DeviceMappings()
    engine = CopyEngine(workers=2)
    try:
        assert child.stdout is not None and child.stdin is not None
        msgs: dict[str, list[types_pb2.DeviceBuffer]] = {"k": [], "v": []}
        event = b""
        for line in child.stdout:
            kind, _, payload = line.strip().partition(" ")
            if kind == "ready":
                break
            if kind == "event":
                event = bytes.fromhex(payload)
            else:
                msgs[kind].append(types_pb2.DeviceBuffer.FromString(bytes.fromhex(payload)))
        k = [mappings.open(ipc_spec(b)) for b in msgs["k"]]
        v = [mappings.open(ipc_spec(b)) for b in msgs["v"]]
        assert mappings.open_count == 1  # one allocation, four buffers
        expected = expected_buffers(seed)
        for got, want in zip([*k, *v], expected, strict=True):
            assert got.is_cuda and torch.equal(got.view(torch.int16).cpu(), want)

        view = DevicePoolView("kv", k, v, PAGE, [0, 1], Medium.CUDA)
        host = make_host(spec_of(), pages=16)
        dev_pages = np.array([7, 1, 2, 3, 11], dtype=np.int64)
        host_pages = np.array([0, 5, 6, 9, 15], dtype=np.int64)
        fence = cuda_ipc_event_fence(event, msgs["k"][0].handle.cuda_ipc.device_id)
        plan = build_plan(Direction.D2H, [(view, host, dev_pages, host_pages)])
        engine.submit(plan, priority=Priority.WRITE_BACK, owner="w", ready=fence).result(timeout=60)
        for i, want in enumerate(expected):
            kv, layer = divmod(i, 2)
            got = host.kv_layer_pages(kv, layer).view(torch.int16)[torch.from_numpy(host_pages)]
            assert torch.equal(got, pages_of(want.view(torch.bfloat16))[torch.from_numpy(dev_pages)])

        new_pages = np.array([0, 4, 5, 9, 10], dtype=np.int64)
        layers: list[int] = []
        plan = build_plan(Direction.H2D, [(view, host, new_pages, host_pages)])
        engine.submit(plan, priority=Priority.DEMAND, owner="w", on_layer=layers.append).result(timeout=60)
        assert layers == [0, 1]
        for want in expected:
            p = pages_of(want.view(torch.bfloat16))
            p[torch.from_numpy(new_pages)] = p[torch.from_numpy(dev_pages)].clone()
        child.stdin.write("dump\n")
        child.stdin.flush()
        digests = [child.stdout.readline().strip() for _ in range(4)]
        assert child.stdout.readline().strip() == "end"
        assert digests == [hashlib.sha256(w.numpy().tobytes()).hexdigest() for w in expected]
        del k, v, view, plan
    finally:
        engine.close()
        mappings.close()
        if child.poll() is None and child.stdin is not None:
            child.stdin.write("exit\n")
            child.stdin.flush()
        try:
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert child.returncode == 0


@pytest.mark.parametrize(
    ("sp", "dp"),
    [
        (np.r_[0:16], np.r_[16:32]),  # one run
        (np.random.default_rng(1).permutation(32)[:16], np.random.default_rng(2).permutation(32)[:16]),
    ],
    ids=["runs", "scattered"],
)
def test_cuda_routes_in_process_are_byte_exact(sp: np.ndarray, dp: np.ndarray) -> None:
    sp, dp = sp.astype(np.int64), dp.astype(np.int64)
    gen = torch.Generator().manual_seed(3)
    host = torch.randint(-(2**15), 2**15, (32, 4, 2, 8), dtype=torch.int16, generator=gen)
    dev = torch.zeros(32, 4, 2, 8, dtype=torch.int16, device="cuda")
    ctx = CopyContext()
    try:
        run_copy(PageCopy(host, dev, sp, dp), ctx)
        ctx.flush()
        expected = torch.zeros_like(host)
        expected[torch.from_numpy(dp)] = host[torch.from_numpy(sp)]
        assert torch.equal(dev.cpu(), expected)
        back = torch.zeros_like(host)
        run_copy(PageCopy(dev, back, dp, sp), ctx)
        ctx.flush()
        want = torch.zeros_like(host)
        want[torch.from_numpy(sp)] = host[torch.from_numpy(sp)]
        assert torch.equal(back, want)
    finally:
        ctx.close()
