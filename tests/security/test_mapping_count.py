"""Buffers far apart in a memfd cannot run the daemon out of descriptors or mappings.

The daemon maps a handed-over memfd once per run of nearby buffers (only the span they
use). Each mapping kept a duplicate of the memfd's descriptor (``mmap.mmap``'s), so a client
whose buffers sat 2 MiB apart in one sparse memfd made one descriptor per buffer: 39
sessions of 512 buffers used the daemon's 20,000, and every other client's attach failed
with EMFILE (a review). Now a mapping holds no descriptor, and what a peer's sessions map
is bounded (``limits.max_mappings_per_peer``): each mapping is one of the kernel's
``vm.max_map_count`` areas for the whole daemon.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import grpc
import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError, Session, WorkerIdentity, pool_spec
from hicached_client.export import export_fd_tensor
from hicached_client.v1 import types_pb2 as tpb

from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import KV_DIM, KV_HEADS, PAGE_SIZE, unique_tag

LAYERS = 64  # 128 buffers (K and V)
STRIDE = 2 << 20  # over the 1 MiB gap that joins buffers into one mapping
LIMIT = 200  # one such attach fits, two do not


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon("--set", f"limits.max_mappings_per_peer={LIMIT}")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def sparse_fd() -> Iterator[int]:
    fd = os.memfd_create("hcsec-far-apart", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 2 * LAYERS * STRIDE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        yield fd
    finally:
        os.close(fd)


def far_apart_pool(fd: int) -> tpb.PoolSpec:
    template = torch.empty(PAGE_SIZE, KV_HEADS, KV_DIM, dtype=torch.float16)
    msgs = [export_fd_tensor(fd, i * STRIDE, template) for i in range(2 * LAYERS)]
    return pool_spec(
        "kv", role="anchor", kind="mha", dtype="float16", host_layout="layer_first", page_size=PAGE_SIZE,
        num_layers=LAYERS, num_heads=KV_HEADS, head_dim=KV_DIM, k_buffers=msgs[:LAYERS],
        v_buffers=msgs[LAYERS:], host_bytes=8 << 20,
    )  # fmt: skip


def attach(client: HiCacheClient, fd: int) -> Session:
    return client.attach(WorkerIdentity(unique_tag("far"), 1, "m-far"), [far_apart_pool(fd)], heartbeat=False)


def descriptors(daemon: Daemon) -> int:
    return len(os.listdir(f"/proc/{daemon.process.pid}/fd"))


def test_buffers_far_apart_hold_no_descriptor_each(daemon: Daemon, sparse_fd: int) -> None:
    """Fails before the fix: the attach's 128 mappings held 128 more descriptors."""
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        before = descriptors(daemon)
        session = attach(client, sparse_fd)
        try:
            grown = descriptors(daemon) - before
            assert grown < 16, f"an attach of {2 * LAYERS} far-apart buffers holds {grown} more descriptors"
        finally:
            session.close()


def test_a_peer_maps_at_most_its_mapping_limit(daemon: Daemon, sparse_fd: int) -> None:
    """Fails before the fix: nothing counted the mappings; the second attach was mapped too."""
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        first = attach(client, sparse_fd)
        try:
            with pytest.raises(HiCacheError) as err:
                attach(client, sparse_fd)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"limits.max_mappings_per_peer={LIMIT}" in err.value.message
            assert f"already hold {2 * LAYERS}" in err.value.message and len(err.value.message) < 500
        finally:
            first.close()
        attach(client, sparse_fd).close()  # the first session's mappings are gone with it
