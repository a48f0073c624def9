"""Zero-copy: the daemon maps SGLang's shm host pool and copies pages itself.

Real SGLang host pools (``allocator_type="shm"``) over a real daemon. The proof
that no page is copied in this process: no staging area is ever allocated
(``StagingArea.allocated`` is unchanged) and the bytes still arrive.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hicached_client import HiCacheClient
from hicached_client.sglang.staging import StagingArea
from hicached_client.sglang.zerocopy import install_sealed_shm, is_sealed
from sglang.srt.mem_cache.storage import mmap as sgl_mmap

from tests.sglang.pools import PoolShape, StorageFactory, make_host_pool, page_bits, sglang_keys, unique_model
from tests.support.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sealed_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sgl_mmap, "alloc_shm", sgl_mmap.alloc_shm)  # restored after the test
    install_sealed_shm()


def _round_trip(storages: StorageFactory, shape: PoolShape, allocator: str) -> tuple[object, str]:
    pool = make_host_pool(shape, allocator_type=allocator)
    storage = storages.make(pool, model=unique_model(), staging_pages=4)
    keys = sglang_keys(10, shape.page_size)
    src = pool.alloc(10 * shape.page_size)
    want = page_bits(pool, src)
    assert storage.batch_set_v1(keys, src) == [True] * 10
    dst = pool.alloc(10 * shape.page_size)
    assert page_bits(pool, dst) != want
    assert storage.batch_get_v1(keys, dst) == [True] * 10
    assert page_bits(pool, dst) == want
    return storage, storage.links["kv"].path


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_sealed_shm_pool_is_zero_copy_and_byte_exact(
    storages: StorageFactory, sealed_shm: None, mla: bool, caplog: pytest.LogCaptureFixture
) -> None:
    before = StagingArea.allocated
    with caplog.at_level(logging.INFO, logger="hicached_client.sglang.link"):
        _, path = _round_trip(storages, PoolShape(mla=mla, layout="page_first"), "shm")
    assert path == "zero-copy"
    assert StagingArea.allocated == before, "a staging area was allocated on the zero-copy path"
    assert any("path zero-copy" in r.getMessage() for r in caplog.records)


def test_zero_copy_pages_are_shared_with_the_staging_path(storages: StorageFactory, sealed_shm: None) -> None:
    """Pages written zero-copy read back byte-exact through a staging-path instance."""
    shape = PoolShape(layout="page_first")
    model = unique_model()
    zc_pool = make_host_pool(shape, allocator_type="shm")
    zc = storages.make(zc_pool, model=model, staging_pages=4)
    assert zc.links["kv"].path == "zero-copy"
    keys = sglang_keys(6, shape.page_size)
    src = zc_pool.alloc(6 * shape.page_size)
    assert zc.batch_set_v1(keys, src) == [True] * 6

    plain = make_host_pool(shape)
    staged = storages.make(plain, model=model, staging_pages=4)
    assert staged.links["kv"].path == "staging"
    dst = plain.alloc(6 * shape.page_size)
    assert staged.batch_get_v1(keys, dst) == [True] * 6
    assert page_bits(plain, dst) == page_bits(zc_pool, src)


def test_sglang_own_shm_memfd_cannot_be_sealed_so_staging_is_used(
    storages: StorageFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang 0.5.23 creates its memfd without MFD_ALLOW_SEALING: the adapter falls back, saying why."""
    pool = make_host_pool(PoolShape(layout="page_first"), allocator_type="shm")
    fd = pool.allocator.fd
    assert not is_sealed(fd)
    with pytest.raises(PermissionError):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    before = StagingArea.allocated
    with caplog.at_level(logging.INFO, logger="hicached_client.sglang.link"):
        storage = storages.make(pool, model=unique_model(), staging_pages=4)
    assert storage.links["kv"].path == "staging"
    assert StagingArea.allocated == before + 1
    assert any("MFD_ALLOW_SEALING" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("allocator", "layout"), [("default", "page_first"), ("shm", "layer_first")])
def test_other_allocators_and_layouts_use_staging(
    storages: StorageFactory, sealed_shm: None, allocator: str, layout: str
) -> None:
    before = StagingArea.allocated
    _, path = _round_trip(storages, PoolShape(layout=layout), allocator)
    assert path == "staging"
    assert StagingArea.allocated == before + 1


PLUGIN_PROBE = """
import tests.sglang.env
from sglang.srt.plugins import load_plugins
from hicached_client.sglang.zerocopy import is_sealed
from tests.support.daemon import Daemon
from tests.sglang.pools import PoolShape, make_host_pool
load_plugins()
pool = make_host_pool(PoolShape(layout="page_first"), allocator_type="shm")
print("sealed" if is_sealed(pool.allocator.fd) else "unsealed")
"""


def _declared_plugin() -> tuple[str, str]:
    """(name, target) of the client package's ``sglang.srt.plugins`` entry point."""
    plugins = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())["project"]["entry-points"]
    ((name, target),) = plugins["sglang.srt.plugins"].items()
    return name, target


def test_declared_sglang_plugin_seals_the_shm_pool_in_a_fresh_process(tmp_path: Path) -> None:
    """The entry point the client package declares, run by SGLang's own load_plugins, seals the pool.

    The installed distribution's metadata may predate this entry point, so the
    declared line is installed as a throwaway distribution on the child's path.
    """
    name, target = _declared_plugin()
    assert target == "hicached_client.sglang.zerocopy:install_sealed_shm"
    dist = tmp_path / "hicached_zc_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hicached-zc-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{name} = {target}\n")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env["SGLANG_PLUGINS"] = name
    out = subprocess.run(
        [sys.executable, "-c", PLUGIN_PROBE],
        check=False,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "sealed"


def test_a_lost_zero_copy_session_is_attached_again_zero_copy(
    daemon: Daemon, storages: StorageFactory, sealed_shm: None
) -> None:
    """After the daemon forgets the session, the link re-attaches, handing the pool's fd over again."""
    shape = PoolShape(layout="page_first")
    pool = make_host_pool(shape, allocator_type="shm")
    storage = storages.make(pool, model=unique_model())
    keys = sglang_keys(4, shape.page_size)
    src = pool.alloc(4 * shape.page_size)
    assert storage.batch_set_v1(keys[:2], src[: 2 * shape.page_size]) == [True, True]
    link = storage.links["kv"]
    lost = link.session.session_id
    with HiCacheClient(daemon.target) as client:
        client.session(lost, session_secret=link.session.info.session_secret).detach()
    before = StagingArea.allocated
    assert storage.batch_set_v1(keys[2:], src[2 * shape.page_size :]) == [True, True]
    assert storage.links["kv"].session.session_id != lost
    assert storage.links["kv"].path == "zero-copy"
    assert StagingArea.allocated == before
    dst = pool.alloc(4 * shape.page_size)
    assert storage.batch_get_v1(keys, dst) == [True] * 4
    assert page_bits(pool, dst) == page_bits(pool, src)


@pytest.mark.parametrize("fast_lane", [True, False], ids=["lane", "grpc"])
def test_page_calls_ride_the_fast_lane_unless_turned_off(
    storages: StorageFactory, sealed_shm: None, fast_lane: bool
) -> None:
    """``fast_lane`` (default true): batch_set_v1/batch_get_v1 and batch_exists (SGLang's hit
    query) are lane records, not gRPC calls; false keeps them on gRPC. The bytes and the
    answers are the same either way. Before: gRPC only."""
    shape = PoolShape(layout="page_first")
    pool = make_host_pool(shape, allocator_type="shm")
    storage = storages.make(pool, model=unique_model(), staging_pages=4, fast_lane=fast_lane)
    keys = sglang_keys(8, shape.page_size)
    src, dst = pool.alloc(8 * shape.page_size), pool.alloc(8 * shape.page_size)
    assert storage.batch_set_v1(keys, src) == [True] * 8
    assert storage.batch_exists(keys) == 8
    assert storage.batch_exists([*keys[:3], "never-stored", *keys[3:]]) == 3
    assert storage.batch_get_v1(keys, dst) == [True] * 8
    assert page_bits(pool, dst) == page_bits(pool, src)
    lane = storage.links["kv"].session._slot._lane
    if fast_lane:
        assert lane is not None and lane._tail == 6, "two puts, two lookups and two gets, on the lane"
    else:
        assert lane is None
