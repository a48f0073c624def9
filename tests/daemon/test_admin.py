"""Issue 5, admin: Drain flushes pending L3 backups and refuses new sessions (Resume undoes it);
ClearNamespace drops one model's pages from L2 and L3 and leaves another model's. Admin calls
go to the admin socket (issue 9)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hicached_client import HiCacheClient, HiCacheError, TokenChain, WorkerIdentity

from tests.daemon.conftest import new_pools, start_file_daemon
from tests.support.kv import PAGE_SIZE, POOLS, WorkerPools, transfers, unique_tag

PAGES = 16


def chain(salt: str, offset: int = 0) -> TokenChain:
    return TokenChain(list(range(offset, offset + PAGES * PAGE_SIZE)), cache_salt=salt)


def l3_pages(client: HiCacheClient) -> int:
    (backend,) = client.get_stats().backends
    assert backend.name == "file"
    return backend.pages


def health_status(target: str, service: str) -> str:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def test_drain_flushes_backups_then_refuses_new_sessions(
    l3_dir: Path, worker_pools: list[WorkerPools]
) -> None:
    tag, pools = new_pools(worker_pools, seed=81)
    daemon = start_file_daemon(l3_dir, "--set", "l3.write_policy=write_back")
    try:
        with (
            HiCacheClient(daemon.target, timeout_s=30.0) as client,
            HiCacheClient(daemon.admin_target, timeout_s=30.0) as admin,
        ):
            model = "m-drain"
            with client.attach(WorkerIdentity(tag, generation=1, model_name=model), pools.specs()) as s:
                keys = chain("tenant-drain")
                assert s.put_pages(keys, transfers(range(PAGES))).stored_pages == PAGES
                assert l3_pages(client) == 0, "write_back with free host room: the pages wait in L2"

                drained = admin.drain(wait_flush=True)
                assert drained.flushed_pages == PAGES
                assert l3_pages(client) == PAGES * len(POOLS), (
                    "every pending page is in L3 when Drain returns"
                )
                assert client.get_stats().draining
                # Readiness (the worker-facing service) goes NOT_SERVING; liveness ("") stays SERVING.
                assert health_status(daemon.target, "hicached.v1.HiCacheService") == "NOT_SERVING"
                assert health_status(daemon.target, "") == "SERVING"

                _, other = new_pools(worker_pools, seed=None)
                with pytest.raises(HiCacheError) as refused:
                    client.attach(
                        WorkerIdentity(unique_tag("late"), generation=1, model_name=model), other.specs()
                    )
                assert refused.value.code == grpc.StatusCode.UNAVAILABLE
                assert "draining" in refused.value.message
                # The attached worker keeps working while the daemon drains.
                found = s.lookup(keys)
                assert (found.l2_hit_pages, found.total_hit_pages) == (PAGES, PAGES)
                assert s.write(transfers([100, 101]), allocate=True).ok

                assert admin.resume() is True, "Drain is undone by Resume"
                assert not client.get_stats().draining
                assert health_status(daemon.target, "hicached.v1.HiCacheService") == "SERVING"
                _, again = new_pools(worker_pools, seed=None)
                late = client.attach(
                    WorkerIdentity(unique_tag("late"), generation=1, model_name=model), again.specs()
                )
                late.detach()
    finally:
        daemon.stop()


def test_clear_namespace_drops_one_model_from_l2_and_l3(
    l3_dir: Path, worker_pools: list[WorkerPools]
) -> None:
    tag_a, pools_a = new_pools(worker_pools, seed=82)
    tag_b, pools_b = new_pools(worker_pools, seed=83)
    daemon = start_file_daemon(l3_dir)
    keys = chain("tenant-x")  # the same tokens and tenant under both models
    try:
        with (
            HiCacheClient(daemon.target, timeout_s=30.0) as client,
            HiCacheClient(daemon.admin_target, timeout_s=30.0) as admin,
            client.attach(WorkerIdentity(tag_a, generation=1, model_name="m-gone"), pools_a.specs()) as a,
            client.attach(WorkerIdentity(tag_b, generation=1, model_name="m-kept"), pools_b.specs()) as b,
        ):
            for s in (a, b):
                assert s.put_pages(keys, transfers(range(PAGES))).stored_pages == PAGES
                backed = s.backup(keys, wait=True)
                assert backed.stored_pages == backed.queued_pages
                assert s.lookup(keys).total_hit_pages == PAGES
            in_l3 = l3_pages(client)
            assert in_l3 == 2 * PAGES * len(POOLS), "the backend counts one page per key and pool"

            cleared = admin.clear_namespace("m-gone")
            assert (cleared.l2_pages, cleared.l3_pages) == (PAGES, PAGES)
            gone = a.lookup(keys)
            assert (gone.l2_hit_pages, gone.total_hit_pages) == (0, 0)
            assert a.get_pages(keys, transfers(range(200, 200 + PAGES)), include_l3=True).hit_pages == 0
            assert l3_pages(client) == in_l3 - PAGES * len(POOLS)

            kept = b.lookup(keys)
            assert (kept.l2_hit_pages, kept.total_hit_pages) == (PAGES, PAGES)
            stored = {pool: pools_b.digest(pool, range(PAGES)) for pool in POOLS}
            pools_b.clobber()
            assert b.get_pages(keys, transfers(range(200, 200 + PAGES))).hit_pages == PAGES
            assert {pool: pools_b.digest(pool, range(200, 200 + PAGES)) for pool in POOLS} == stored
    finally:
        daemon.stop()


def test_clear_namespace_after_a_restart_says_it_cannot_find_the_models_groups(
    l3_dir: Path, worker_pools: list[WorkerPools]
) -> None:
    """Fails before (a review that restarted daemons): a clear of a model none of whose groups
    was re-created since the start answered 0 pages cleared, and the pages it should have
    dropped came back from L3 at the next attach. Now FAILED_PRECONDITION says what to do; once
    a worker of the model attached, the clear finds its group and its L3 pages."""
    tag, pools = new_pools(worker_pools, seed=84)
    worker = WorkerIdentity(tag, generation=1, model_name="m-restarted")
    keys = chain("tenant-r")
    daemon = start_file_daemon(l3_dir)
    try:
        with (
            HiCacheClient(daemon.target, timeout_s=30.0) as client,
            client.attach(worker, pools.specs()) as s,
        ):
            assert s.put_pages(keys, transfers(range(PAGES))).stored_pages == PAGES
            backed = s.backup(keys, wait=True)
            assert backed.stored_pages == backed.queued_pages
            assert l3_pages(client) == PAGES * len(POOLS)
    finally:
        daemon.stop()
    daemon = start_file_daemon(l3_dir)
    try:
        with (
            HiCacheClient(daemon.target, timeout_s=30.0) as client,
            HiCacheClient(daemon.admin_target, timeout_s=30.0) as admin,
        ):
            with pytest.raises(HiCacheError) as refused:
                admin.clear_namespace("m-restarted")
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "attach a worker of the model" in refused.value.message
            with client.attach(worker, pools.specs()) as s:
                assert s.lookup(keys).total_hit_pages == PAGES  # in L3: nothing was cleared
                cleared = admin.clear_namespace("m-restarted")
                assert cleared.l3_pages == PAGES
                assert s.lookup(keys).total_hit_pages == 0
    finally:
        daemon.stop()
