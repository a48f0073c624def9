"""Op ids against a real daemon: one mechanism keyed by (RPC, op_id) with a digest of the
request, remembering only answers no retry could change, bounded in bytes per session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import pytest
from hicached_client import HiCacheError, PageBytes, Session, WorkerIdentity

from tests.robustness.state_support import device_pools, no_retry_client, specs
from tests.support.daemon import Daemon, start_daemon
from tests.support.state import proc_bytes

OP_CACHE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon(
        "--set", f"sessions.op_cache_bytes={OP_CACHE_BYTES}", "--set", "server.max_batch_pages=65536"
    )  # fmt: skip
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def session(daemon: Daemon) -> Iterator[Session]:
    with device_pools() as device, no_retry_client(daemon.target) as client:
        s = client.attach(
            WorkerIdentity(f"w-{uuid.uuid4().hex[:8]}", 1, f"m-{uuid.uuid4().hex[:8]}"),
            specs(device, names=("kv", "swa")),
        )
        try:
            yield s
        finally:
            s.close()


def _pages(session: Session, prefix: str, n: int, fill: int = 1) -> list[PageBytes]:
    sizes = {p.name: p.page_bytes for p in session.info.pools}
    return [PageBytes(f"{prefix}{i}", pool, bytes([fill]) * sizes[pool]) for i in range(n) for pool in sizes]


def test_a_retry_after_resource_exhausted_succeeds_once_room_exists(session: Session) -> None:
    """Fails before the fix: the RESOURCE_EXHAUSTED was cached under the op_id, so every retry
    with the same op_id (which is what the client library sends) replayed it."""
    total = next(p.total_pages for p in session.info.pools if p.name == "kv")
    held = session.alloc("kv", total)
    assert held.ok
    body = _pages(session, "k", 2)
    with pytest.raises(HiCacheError) as err:
        session.put_bytes(body, op_id="put-after-backpressure")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    session.free("kv", held.host_pages)
    assert session.put_bytes(body, op_id="put-after-backpressure").stored_pages == 2
    again = session.put_bytes(body, op_id="put-after-backpressure")  # replayed: stored once
    assert again.stored_pages == 2
    assert session.stats().groups[0].indexed_pages == 2


def test_an_op_id_reused_on_another_rpc_is_an_independent_operation(session: Session) -> None:
    """Fails before the fix: Free with Alloc's op_id got Alloc's stored answer and the
    servicer failed building its reply (INTERNAL)."""
    got = session.alloc("kv", 3, op_id="same-id")
    assert got.ok
    assert session.free("kv", got.host_pages, op_id="same-id") == 3
    assert session.stats().sessions[0].owned_pages == 0


def test_the_same_op_id_with_another_body_is_invalid_argument(session: Session) -> None:
    """Fails before the fix: the second request silently got the first request's answer."""
    op = "op-" + "z" * 250  # just under limits.max_identity_bytes (a longer one is refused at once)
    assert session.alloc("kv", 1, op_id=op).ok
    with pytest.raises(HiCacheError) as err:
        session.alloc("kv", 2, op_id=op)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "op_id 'op-zzz" in err.value.message and len(err.value.message) < 250
    assert session.stats().sessions[0].owned_pages == 1


def test_400_alloc_free_rounds_keep_the_op_cache_within_its_byte_bound(daemon: Daemon) -> None:
    """Fails before the fix: every answer was remembered (the issue measured +211 MB of daemon
    RSS for 400 rounds of 65,536-page answers; these 16,384-page rounds add ~55 MB); now
    sessions.op_cache_bytes (1 MiB here) bounds them, so RSS stays flat."""
    pages = 16_384
    with no_retry_client(daemon.target) as client, device_pools() as device:
        kv = specs(device, names=("kv",))[0]
        kv.ClearField("k_buffers")
        kv.ClearField("v_buffers")
        kv.host_size.bytes = (pages + 8) * LAYERS_BYTES
        s = client.attach(WorkerIdentity(f"w-{uuid.uuid4().hex[:8]}", 1, "m-ops-bound"), [kv])
        try:
            warm = s.alloc("kv", pages, op_id="warm")
            s.free("kv", warm.host_pages, op_id="warm-free")
            before = proc_bytes(daemon.process.pid, "VmRSS")
            for i in range(400):
                got = s.alloc("kv", pages, op_id=f"a{i}")
                assert got.ok
                assert s.free("kv", got.host_pages, op_id=f"f{i}") == pages
            grown = proc_bytes(daemon.process.pid, "VmRSS") - before
        finally:
            s.close()
    assert grown < 24 << 20, f"daemon RSS grew {grown / 2**20:.0f} MiB over 400 rounds"


LAYERS_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # K and V x layers x page tokens x heads x dim x fp16
