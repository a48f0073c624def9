"""Client-side export helpers: wire dtypes, shm buffer descriptors, the worker's shm pool."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from hicached_client.export import ShmKVPool, dtype_from_wire, dtype_to_wire, export_shm_tensor
from hicached_client.v1 import types_pb2

from hicached.l2.shm import SharedSegment
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


def test_export_shm_tensor_adds_the_storage_offset() -> None:
    base = torch.zeros(64, dtype=torch.float16)
    msg = export_shm_tensor("seg", 4096, base[16:].view(6, 8))
    assert msg.handle.WhichOneof("kind") == "shm"
    assert (msg.handle.shm.name, msg.handle.shm.offset, msg.handle.shm.size) == ("seg", 4096 + 32, 96)
    assert list(msg.shape) == [6, 8] and msg.dtype == types_pb2.DATA_TYPE_FLOAT16
    with pytest.raises(ValueError, match="contiguous"):
        export_shm_tensor("seg", 0, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="base_offset"):
        export_shm_tensor("seg", -1, base)


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
        offsets = [m.handle.shm.offset for m in msgs]
        assert all(off % 4096 == 0 for off in offsets) and len(set(offsets)) == len(msgs)
        for i, t in enumerate([*pool.k, *pool.v]):
            t.fill_(i + 1)
        for i, m in enumerate(msgs):
            view = mappings.open(buffer_spec(m))
            assert view.shape == (20, 2, 6) and bool((view == i + 1).all())
            del view
        assert mappings.open_count == 1
    finally:
        mappings.close()
        pool.close()
        pool.unlink()
    assert not SharedSegment.exists(name)
    pool.close()
    pool.unlink()  # both idempotent
    with pytest.raises(ValueError, match="closed"):
        pool.k_buffers()


def test_shm_pool_refuses_bad_geometry_and_taken_names(unique: Callable[[str], str]) -> None:
    with pytest.raises(ValueError, match="tokens must be a positive int, got 0"):
        ShmKVPool(unique("x"), num_layers=1, tokens=0, heads=1, head_dim=1, dtype=torch.float16)
    with pytest.raises(ValueError, match="cannot be sent"):
        ShmKVPool(unique("x"), num_layers=1, tokens=4, heads=1, head_dim=1, dtype=torch.float64)
    name = unique("taken")
    with (
        ShmKVPool(name, num_layers=1, tokens=4, heads=1, head_dim=4, dtype=torch.float16),
        pytest.raises(FileExistsError),
    ):
        ShmKVPool(name, num_layers=1, tokens=4, heads=1, head_dim=4, dtype=torch.float16)
    assert not os.path.exists(f"/dev/shm/{name}")


def test_shm_pool_outlives_its_creator_until_unlinked(unique: Callable[[str], str]) -> None:
    name = unique("orphan")
    code = (
        "import sys, torch\n"
        "from hicached_client.export import ShmKVPool\n"
        "p = ShmKVPool(sys.argv[1], num_layers=1, tokens=8, heads=1, head_dim=8, dtype=torch.float16)\n"
        "p.k[0].fill_(3)\n"
    )
    subprocess.run([sys.executable, "-c", code, name], check=True, timeout=120)
    try:
        assert SharedSegment.exists(name)  # no resource tracker removed it at exit
        seg = SharedSegment.open(name)
        assert bool((seg.tensor(torch.float16, (64,), 0) == 3).all())
        seg.close()
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_client_export_module_does_not_import_the_daemon() -> None:
    code = (
        "import sys, hicached_client.export\nprint(any(m.split('.')[0] == 'hicached' for m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"
