"""A handed-over memfd's size cannot take the daemon's address space.

A file's size costs a client nothing: a sealed memfd ftruncated to 64 TiB holds no
memory. When the daemon mapped every handed-over memfd whole, a few dozen tiny
attaches took it to 127 TiB of virtual size, and then every client's mmap and the
daemon's own thread starts failed (ENOMEM). It maps only what the buffers use.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import grpc
import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError, Transfer, WorkerIdentity, pool_spec
from hicached_client.export import export_fd_tensor
from hicached_client.v1 import types_pb2 as tpb

from tests.support.daemon import Daemon
from tests.support.kv import KV_DIM, KV_HEADS, PAGE_SIZE, unique_tag
from tests.support.state import proc_bytes

TIB = 1 << 40
TOKENS = 16 * PAGE_SIZE  # 16 device pages per buffer
LAYERS = 2


def _kv_spec(name: str, msgs: list[tpb.DeviceBuffer], **host: float) -> tpb.PoolSpec:
    """An MHA pool of LAYERS layers whose K buffers are ``msgs``' first half, V the second."""
    return pool_spec(
        name,
        role="anchor",
        kind="mha",
        dtype="float16",
        host_layout="layer_first",
        page_size=PAGE_SIZE,
        num_layers=LAYERS,
        num_heads=KV_HEADS,
        head_dim=KV_DIM,
        k_buffers=msgs[:LAYERS],
        v_buffers=msgs[LAYERS:],
        **host,  # type: ignore[arg-type]
    )


def test_a_tiny_pool_in_a_1_tib_sparse_memfd_maps_only_its_buffers_and_round_trips(daemon: Daemon) -> None:
    fd = os.memfd_create("hcsec-sparse-tib", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, TIB)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        # The worker's own buffers: K and V of every layer, back to back at the file's start.
        template = torch.empty(TOKENS, KV_HEADS, KV_DIM, dtype=torch.float16)
        buf_bytes = template.numel() * template.element_size()
        # Unmapped when the last view of it dies (at the end of the test).
        mine = mmap.mmap(fd, 2 * LAYERS * buf_bytes, flags=mmap.MAP_SHARED)
        flat = torch.frombuffer(mine, dtype=torch.float16)
        bufs = list(flat.view(2 * LAYERS, TOKENS, KV_HEADS, KV_DIM).unbind(0))
        msgs = [export_fd_tensor(fd, i * buf_bytes, template) for i in range(2 * LAYERS)]
        spec = _kv_spec("kv", msgs, host_ratio=1.0)
        pid = daemon.process.pid
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            before = proc_bytes(pid, "VmSize")
            session = client.attach(
                WorkerIdentity(unique_tag("sparse"), 1, "m-sparse"), [spec], heartbeat=False
            )
            try:
                grown = proc_bytes(pid, "VmSize") - before
                assert grown < 1 << 30, f"the attach grew the daemon's VmSize by {grown} bytes"

                torch.manual_seed(5)
                for b in bufs:
                    b.copy_(torch.randn(b.shape, dtype=torch.float16))
                want = [b[: 4 * PAGE_SIZE].clone() for b in bufs]  # device pages 0..3
                w = session.write([Transfer("kv", [0, 1, 2, 3])], allocate=True)
                assert w.ok
                for b in bufs:
                    b.zero_()
                session.load_wait([Transfer("kv", [8, 9, 10, 11], w.transfers[0].host_pages)])
                for b, expected in zip(bufs, want, strict=True):
                    got = b[8 * PAGE_SIZE : 12 * PAGE_SIZE]
                    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
                    assert not b[: 8 * PAGE_SIZE].any()  # nothing landed outside the loaded pages
            finally:
                session.close()
    finally:
        os.close(fd)
    assert daemon.process.poll() is None, daemon.log


def _huge_pool(fd: int, name: str, offset: int, buffer_bytes: int) -> tpb.PoolSpec:
    """A pool whose four buffers declare ``buffer_bytes`` each, back to back from ``offset`` of
    a sparse memfd (nothing is written: the daemon maps what they declare)."""
    template = torch.empty(PAGE_SIZE, KV_HEADS, KV_DIM, dtype=torch.float16)
    msgs = [export_fd_tensor(fd, offset + i * buffer_bytes, template) for i in range(2 * LAYERS)]
    for msg in msgs:  # declared as large as it likes: the message is the client's to write
        msg.handle.fd.size = buffer_bytes
        msg.shape[0] = buffer_bytes // (KV_HEADS * KV_DIM * 2)
    return _kv_spec(name, msgs, host_bytes=64 << 20)


def test_a_peer_maps_at_most_its_buffer_byte_limit(daemon: Daemon) -> None:
    """Buffers as large as a sparse memfd allows cost their peer nothing: the daemon counts
    what a peer's live sessions declare (limits.max_buffer_bytes_per_peer, 1 TiB) and refuses
    past it before mapping anything. Before the limit, each such attach mapped 2 TiB."""
    fd = os.memfd_create("hcsec-sparse-huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 8 * TIB)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        pid = daemon.process.pid
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            before = proc_bytes(pid, "VmSize")
            with pytest.raises(HiCacheError) as err:  # 4 x 512 GiB in one attach
                client.attach(
                    WorkerIdentity(unique_tag("huge"), 1, "m-huge"),
                    [_huge_pool(fd, "kv", 0, TIB // 2)],
                    heartbeat=False,
                )
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limits.max_buffer_bytes_per_peer=1099511627776" in err.value.message
            grown = proc_bytes(pid, "VmSize") - before
            assert grown < 1 << 30, f"a refused attach grew the daemon's VmSize by {grown} bytes"

            # The bound is the peer's, over its live sessions: 768 GiB, then 512 GiB more is refused
            # until the first session ends.
            first = client.attach(
                WorkerIdentity(unique_tag("huge"), 1, "m-huge"),
                [_huge_pool(fd, "kv", 0, 3 * TIB // 16)],
                heartbeat=False,
            )
            second_pool = _huge_pool(fd, "kv", 4 * TIB, TIB // 8)
            try:
                with pytest.raises(HiCacheError) as err:
                    client.attach(
                        WorkerIdentity(unique_tag("huge"), 1, "m-huge"), [second_pool], heartbeat=False
                    )
                assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "already hold 824633720832" in err.value.message
            finally:
                first.close()
            second = client.attach(
                WorkerIdentity(unique_tag("huge"), 1, "m-huge"), [second_pool], heartbeat=False
            )
            second.close()
    finally:
        os.close(fd)
    assert daemon.process.poll() is None, daemon.log
