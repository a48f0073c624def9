"""A real worker process hands its memfd KV pool over; the daemon side maps it and copies byte-exact."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import torch
from hicached_client.v1 import types_pb2

from hicached.l2.host_pool import HostKVPool
from hicached.transfer import (
    CopyEngine,
    DeviceMappings,
    DevicePoolView,
    Direction,
    Medium,
    Priority,
    build_plan,
)

from .conftest import PAGE, buffer_spec, pages_of, spec_of

TOKENS = 12 * PAGE
CHILD = textwrap.dedent(
    """
    import hashlib, socket, sys, torch
    from hicached_client.export import ShmKVPool
    name, seed, tokens, sock_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    pool = ShmKVPool(name, num_layers=2, tokens=tokens, heads=2, head_dim=8, dtype=torch.bfloat16)
    with socket.socket(fileno=sock_fd) as sock:
        socket.send_fds(sock, [b"fd"], [pool.fd])
    gen = torch.Generator().manual_seed(seed)
    for t in pool.k + pool.v:
        t.view(torch.int16).copy_(
            torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16, generator=gen))
    for b in pool.k_buffers():
        print("k", b.SerializeToString().hex())
    for b in pool.v_buffers():
        print("v", b.SerializeToString().hex())
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "dump":
            for t in pool.k + pool.v:
                print(hashlib.sha256(t.view(torch.int16).numpy().tobytes()).hexdigest())
            print("end", flush=True)
        else:
            break
    pool.close()
    """
)


def expected_buffers(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-(2**15), 2**15, (TOKENS, 2, 8), dtype=torch.int16, generator=gen) for _ in range(4)
    ]


def test_child_exports_shm_pool_and_daemon_copies_byte_exact(
    unique: Callable[[str], str], make_host: Callable[..., HostKVPool]
) -> None:
    name, seed = unique("worker"), 77
    ours, theirs = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, name, str(seed), str(TOKENS), str(theirs.fileno())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    # The child hands its pool over as a file descriptor, as a worker does to the daemon.
    _, (received,), _, _ = socket.recv_fds(ours, 16, 1)
    ours.close()
    mappings = DeviceMappings()
    engine = CopyEngine(workers=2)
    try:
        assert child.stdout is not None and child.stdin is not None
        k_msgs: list[types_pb2.DeviceBuffer] = []
        v_msgs: list[types_pb2.DeviceBuffer] = []
        for line in child.stdout:
            kind, _, payload = line.strip().partition(" ")
            if kind == "ready":
                break
            (k_msgs if kind == "k" else v_msgs).append(
                types_pb2.DeviceBuffer.FromString(bytes.fromhex(payload))
            )
        assert len(k_msgs) == 2 and len(v_msgs) == 2
        fd_map = {k_msgs[0].handle.fd.fd_index: received}
        views = mappings.open_all([buffer_spec(b, fd_map) for b in (*k_msgs, *v_msgs)])
        k, v = views[: len(k_msgs)], views[len(k_msgs) :]
        os.close(received)  # the mapping keeps the memory, as in the daemon after an attach
        assert mappings.open_count == 1
        expected = expected_buffers(seed)
        for got, want in zip([*k, *v], expected, strict=True):
            assert torch.equal(got.view(torch.int16), want)

        view = DevicePoolView("kv", k, v, PAGE, [0, 1], Medium.CPU)
        host = make_host(spec_of(), pages=16)
        dev_pages = np.array([7, 1, 2, 3, 11], dtype=np.int64)
        host_pages = np.array([0, 5, 6, 7, 15], dtype=np.int64)
        plan = build_plan(Direction.D2H, [(view, host, dev_pages, host_pages)])
        engine.submit(plan, priority=Priority.WRITE_BACK, owner="w").result(timeout=30)
        for i, want in enumerate(expected):
            kv, layer = divmod(i, 2)
            got = host.kv_layer_pages(kv, layer).view(torch.int16)[torch.from_numpy(host_pages)]
            assert torch.equal(got, pages_of(want.view(torch.bfloat16))[torch.from_numpy(dev_pages)])

        # Load the saved pages back into different device pages of the worker.
        new_pages = np.array([0, 4, 5, 9, 10], dtype=np.int64)
        plan = build_plan(Direction.H2D, [(view, host, new_pages, host_pages)])
        engine.submit(plan, priority=Priority.DEMAND, owner="w").result(timeout=30)
        for want in expected:
            p = pages_of(want.view(torch.bfloat16))
            p[torch.from_numpy(new_pages)] = p[torch.from_numpy(dev_pages)].clone()
        child.stdin.write("dump\n")
        child.stdin.flush()
        digests = [child.stdout.readline().strip() for _ in range(4)]
        assert child.stdout.readline().strip() == "end"
        assert digests == [hashlib.sha256(w.numpy().tobytes()).hexdigest() for w in expected]

        del k, v, views, view, plan
        mappings.close()
        with open("/proc/self/maps") as f:
            assert not [line for line in f if f"/memfd:{name}" in line]
        child.stdin.write("exit\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        engine.close()
        mappings.close()
        if child.poll() is None:
            child.kill()
            child.wait()
