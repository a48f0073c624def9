"""Which data path each SGLang pool uses, as the daemon reports it (issue 12, item 2).

``GetStats`` lists every session's pools with ``buffers`` (how the daemon opened
them) and ``data_path`` (the worker's own label, ``PoolSpec.data_path``); the
adapter labels its pools ``zero-copy``, ``staging`` or ``bytes``. Real SGLang host
pools from both allocators against a real daemon, read back over the admin socket
and through ``hicached status``. Before this field the daemon could not tell the
zero-copy and staging paths apart (both are a memfd handed over at attach).
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError, SessionPool, WorkerIdentity, pool_spec
from hicached_client.sglang.layouts import bind_host_pool
from hicached_client.sglang.zerocopy import install_sealed_shm
from sglang.srt.mem_cache.storage import mmap as sgl_mmap

from tests.sglang.pools import PoolShape, StorageFactory, make_host_pool, unique_model
from tests.support.daemon import Daemon


@pytest.fixture
def sealed_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sgl_mmap, "alloc_shm", sgl_mmap.alloc_shm)  # restored after the test
    install_sealed_shm()


def _pools_of(daemon: Daemon, session_id: str) -> tuple[SessionPool, ...]:
    with HiCacheClient(daemon.admin_target) as admin:
        (info,) = [s for s in admin.get_stats().sessions if s.session_id == session_id]
    return info.pools


def _reported(daemon: Daemon, storage: object, pool: str = "kv") -> SessionPool:
    link = storage.links[pool]  # type: ignore[attr-defined]
    (reported,) = _pools_of(daemon, link.session.session_id)
    return reported


def test_shm_allocator_pool_is_reported_zero_copy(
    daemon: Daemon, storages: StorageFactory, sealed_shm: None
) -> None:
    pool = make_host_pool(PoolShape(layout="page_first"), allocator_type="shm")
    storage = storages.make(pool, model=unique_model(), staging_pages=4)
    assert storage.links["kv"].path == "zero-copy"
    assert _reported(daemon, storage) == SessionPool("kv", "memfd", "zero-copy")


def test_default_allocator_pool_is_reported_staging(daemon: Daemon, storages: StorageFactory) -> None:
    pool = make_host_pool(PoolShape(layout="page_first"))
    storage = storages.make(pool, model=unique_model(), staging_pages=4)
    assert storage.links["kv"].path == "staging"
    assert _reported(daemon, storage) == SessionPool("kv", "memfd", "staging")


def test_bytes_transport_and_by_key_tensors_are_reported_byte_only(
    daemon: Daemon, storages: StorageFactory
) -> None:
    pool = make_host_pool(PoolShape())
    storage = storages.make(pool, model=unique_model(), staging_pages=4, transport="bytes")
    assert _reported(daemon, storage) == SessionPool("kv", "bytes", "bytes")
    assert storage.set("odd-sized", torch.arange(7, dtype=torch.int32))  # attaches the byte-path store
    blobs = storage._blobs._current()
    assert _pools_of(daemon, blobs.session_id) == (SessionPool("kv", "bytes", "bytes"),)


def test_hicached_status_prints_each_pool_path(
    daemon: Daemon, storages: StorageFactory, sealed_shm: None
) -> None:
    zc = storages.make(
        make_host_pool(PoolShape(layout="page_first"), allocator_type="shm"), model=unique_model()
    )
    staged = storages.make(make_host_pool(PoolShape(layout="page_first")), model=unique_model())
    out = subprocess.run(
        [sys.executable, "-m", "hicached", "status", "--target", daemon.admin_target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for storage, path in ((zc, "zero-copy"), (staged, "staging")):
        session_line = out.index(storage.links["kv"].session.session_id)
        assert out[session_line:].splitlines()[1].strip() == f"pool kv: buffers memfd, data path {path}"


@pytest.mark.parametrize("label", ["x" * 33, "zero copy", "päth", "a/b"])
def test_a_bad_label_is_refused_and_attaches_nothing(daemon: Daemon, label: str) -> None:
    spec = pool_spec(
        "kv",
        role="anchor",
        kind="mha",
        dtype="float16",
        page_size=4,
        num_layers=1,
        num_heads=1,
        head_dim=8,
        k_buffers=[],
        host_bytes=1 << 20,
        data_path=label,
    )
    with HiCacheClient(daemon.admin_target) as admin:
        before = len(admin.get_stats().sessions)
    with HiCacheClient(daemon.target) as client, pytest.raises(HiCacheError) as err:
        client.attach(WorkerIdentity("bad-label", 1, unique_model()), [spec], heartbeat=False)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "pools[0] ('kv').data_path" in err.value.message and "[A-Za-z0-9._-]" in err.value.message
    with HiCacheClient(daemon.admin_target) as admin:
        assert len(admin.get_stats().sessions) == before


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_host_pages_of_token_slots_are_their_page_numbers_or_a_refusal(dtype: torch.dtype) -> None:
    """SGLang names host pages by their token slots: page-aligned runs of page_size slots."""
    binding = bind_host_pool(make_host_pool(PoolShape()))
    ps = binding.geometry.page_size
    pages = [5, 2, 9, 3]
    slots = torch.tensor([p * ps + t for p in pages for t in range(ps)], dtype=dtype)
    assert binding.host_pages_of(slots, len(pages)).tolist() == pages
    assert binding.host_pages_of(slots.reshape(len(pages), ps), len(pages)).tolist() == pages
    with pytest.raises(ValueError, match="host indices for 3 pages"):
        binding.host_pages_of(slots, 3)
    with pytest.raises(ValueError, match=r"not page-aligned \(page_size=4\): \[21, 9, 37, 13\]"):
        binding.host_pages_of(slots + 1, len(pages))
