"""Client-side export helpers: wire dtypes, fd buffer descriptors, the worker's memfd pool."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from hicached_client.export import ShmKVPool, dtype_from_wire, dtype_to_wire, export_fd_tensor
from hicached_client.v1 import types_pb2

from hicached.transfer import DTYPE_BY_NAME, DeviceMappings

from .conftest import buffer_spec


def test_wire_dtypes_round_trip_and_match_the_daemon_names() -> None:
    for name, dtype in DTYPE_BY_NAME.items():
        wire = dtype_to_wire(dtype)
        assert types_pb2.DataType.Name(wire) == f"DATA_TYPE_{name.upper()}"
        assert dtype_from_wire(wire) is dtype
    with pytest.raises(ValueError, match="float64"):
        dtype_to_wire(torch.float64)
    with pytest.raises(ValueError, match="unknown wire DataType 0"):
        dtype_from_wire(types_pb2.DATA_TYPE_UNSPECIFIED)


def test_export_fd_tensor_adds_the_storage_offset() -> None:
    base = torch.zeros(64, dtype=torch.float16)
    msg = export_fd_tensor(7, 4096, base[16:].view(6, 8))
    assert msg.handle.WhichOneof("kind") == "fd"
    assert (msg.handle.fd.fd_index, msg.handle.fd.offset, msg.handle.fd.size) == (7, 4096 + 32, 96)
    assert list(msg.shape) == [6, 8] and msg.dtype == types_pb2.DATA_TYPE_FLOAT16
    with pytest.raises(ValueError, match="contiguous"):
        export_fd_tensor(7, 0, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="base_offset"):
        export_fd_tensor(7, -1, base)


@pytest.mark.parametrize("mla", [False, True])
def test_shm_pool_buffers_are_page_aligned_views_the_daemon_can_open(
    unique: Callable[[str], str], mla: bool
) -> None:
    name = unique("pool")
    pool = ShmKVPool(name, num_layers=3, tokens=20, heads=2, head_dim=6, dtype=torch.float16, mla=mla)
    mappings = DeviceMappings()
    try:
        assert len(pool.k) == 3 and len(pool.v) == (0 if mla else 3)
        msgs = [*pool.k_buffers(), *pool.v_buffers()]
        assert {m.handle.fd.fd_index for m in msgs} == {pool.fd}
        offsets = [m.handle.fd.offset for m in msgs]
        assert all(off % 4096 == 0 for off in offsets) and len(set(offsets)) == len(msgs)
        for i, t in enumerate([*pool.k, *pool.v]):
            t.fill_(i + 1)
        views = mappings.open_all([buffer_spec(m) for m in msgs])
        for i, view in enumerate(views):
            assert view.shape == (20, 2, 6) and bool((view == i + 1).all())
        del views, view
        assert mappings.open_count == 1
    finally:
        mappings.close()
        pool.close()
    assert not os.path.exists(f"/dev/shm/{name}")  # a memfd never has a name there
    pool.close()
    pool.unlink()  # both idempotent
    with pytest.raises(ValueError, match="closed"):
        pool.k_buffers()


def test_shm_pool_refuses_bad_geometry(unique: Callable[[str], str]) -> None:
    with pytest.raises(ValueError, match="tokens must be a positive int, got 0"):
        ShmKVPool(unique("x"), num_layers=1, tokens=0, heads=1, head_dim=1, dtype=torch.float16)
    with pytest.raises(ValueError, match="cannot be sent"):
        ShmKVPool(unique("x"), num_layers=1, tokens=4, heads=1, head_dim=1, dtype=torch.float64)


def test_shm_pool_memfd_is_sealed_so_it_can_never_shrink(unique: Callable[[str], str]) -> None:
    """The daemon maps only memfds that cannot shrink (a shrink under its mapping is SIGBUS)."""
    with ShmKVPool(
        unique("sealed"), num_layers=1, tokens=8, heads=1, head_dim=8, dtype=torch.float16
    ) as pool:
        seals = fcntl.fcntl(pool.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(pool.fd, 0)
        assert os.fstat(pool.fd).st_size == pool.size


def test_client_export_module_does_not_import_the_daemon() -> None:
    code = (
        "import sys, hicached_client.export\nprint(any(m.split('.')[0] == 'hicached' for m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"
