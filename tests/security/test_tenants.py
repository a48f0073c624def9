"""Issue 9 item 5: tenants are bound to sessions.

Attacks tried on main (each test fails there): the tenant was whatever a call
put in ``KeySource.tenant``; the same tokens without a salt, or another
tenant's raw keys, read that tenant's pages; a page tenant B fetched from L3 was
relabelled B, so clearing tenant A left it behind.

Now a session's tenant is fixed at attach (``WorkerIdentity.tenant``) and keys
are scoped by it inside the daemon: another tenant finds nothing, whatever it
names, and a per-call tenant other than the session's is PERMISSION_DENIED.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hicached_client import (
    HiCacheClient,
    HiCacheError,
    PageBytes,
    Session,
    TokenChain,
    WorkerIdentity,
    pool_spec,
)

from tests.security.roles_helpers import launch, scratch_dir
from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import DEVICE_PAGES, PAGE_SIZE, POOLS, WorkerPools, transfers, unique_tag
from tests.support.state import snapshot

from .users import other_user, run_as_other

MODEL = "m-tenants"
PAGES = 8
SRC = list(range(PAGES))
DST = list(range(100, 100 + PAGES))
TOKENS = TokenChain(list(range(PAGES * PAGE_SIZE)))  # no salt: both tenants hash the same keys


def start(l3: Path) -> Daemon:
    return launch(scratch_dir(), "--l3", "file", "--l3-path", str(l3))


@pytest.fixture
def l3(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "l3"
    shutil.rmtree(tmp_path / "l3", ignore_errors=True)


def pools_of(worker_pools: list[WorkerPools], seed: int | None) -> WorkerPools:
    pools = WorkerPools.create(unique_tag("tn"))
    worker_pools.append(pools)
    pools.fill_random(seed) if seed is not None else pools.clobber()
    return pools


def attach(client: HiCacheClient, tenant: str, pools: WorkerPools) -> Session:
    identity = WorkerIdentity(unique_tag("tn"), generation=1, model_name=MODEL, tenant=tenant)
    return client.attach(identity, pools.specs())


def admin_state(daemon: Daemon) -> dict[str, object]:
    with HiCacheClient(daemon.admin_target, timeout_s=10) as admin:
        return snapshot(admin.get_stats())


def test_tenant_b_reads_nothing_of_tenant_a(l3: Path, worker_pools: list[WorkerPools]) -> None:
    daemon = start(l3)
    try:
        with HiCacheClient(daemon.target, timeout_s=30) as client:
            pools_a, pools_b = pools_of(worker_pools, 11), pools_of(worker_pools, None)
            with attach(client, "tenant-a", pools_a) as a, attach(client, "tenant-b", pools_b) as b:
                assert a.put_pages(TOKENS, transfers(SRC)).stored_pages == PAGES
                raw = list(a.lookup(TOKENS).keys)  # tenant A's keys, as a client sees them
                backed = a.backup(raw, wait=True)  # write_through may have stored them already
                assert backed.stored_pages == backed.queued_pages
                before = admin_state(daemon)

                for keys in (TOKENS, raw):
                    found = b.lookup(keys)
                    assert (found.l2_hit_pages, found.total_hit_pages) == (0, 0)
                    assert b.get_pages(keys, transfers(DST), include_l3=True).hit_pages == 0
                    assert b.get_bytes(keys, include_l3=True).pages == ()
                    assert b.prefetch(keys).planned_pages == 0
                assert all(pools_b.untouched(p, []) for p in POOLS), "nothing was copied into B's pool"
                assert admin_state(daemon) == before

                # Naming A's tenant per call is refused, not obeyed.
                for call in (
                    lambda: b.lookup(raw, tenant="tenant-a"),
                    lambda: b.get_bytes(raw, tenant="tenant-a"),
                    lambda: b.get_pages(raw, transfers(DST), tenant="tenant-a"),
                    lambda: b.put_bytes([PageBytes(raw[0], "kv", b"x")], tenant="tenant-a"),
                    lambda: client.clear_namespace(
                        MODEL, "tenant-a", session_id=b.session_id, session_secret=b.info.session_secret
                    ),
                ):
                    with pytest.raises(HiCacheError) as info:
                        call()
                    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
                    assert "tenant" in info.value.message
                # A key spelling another tenant's scoped key is malformed.
                with pytest.raises(HiCacheError) as bad:
                    b.lookup([raw[0] + "~" + "0" * 32])
                assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert admin_state(daemon) == before

                # B writing under A's raw keys lands in B's space; A still reads its own bytes.
                mine = a.get_bytes(raw[:1])
                forged = [PageBytes(raw[0], p.pool, bytes(len(p.data))) for p in mine.pages]
                assert b.put_bytes(forged).stored_pages == 1
                assert a.get_bytes(raw[:1]).pages == mine.pages

                # B clears its own tenant: A's pages stay.
                cleared = client.clear_namespace(
                    MODEL, session_id=b.session_id, session_secret=b.info.session_secret
                )
                assert cleared.l2_pages == 1
                assert a.lookup(raw).l2_hit_pages == PAGES
    finally:
        daemon.stop()


def test_pages_fetched_from_l3_keep_their_tenant(l3: Path, worker_pools: list[WorkerPools]) -> None:
    """Before: B's fetch from L3 relabelled A's pages B, and clearing tenant A left them in L2."""
    first = start(l3)
    try:
        with (
            HiCacheClient(first.target, timeout_s=30) as client,
            attach(client, "tenant-a", pools_of(worker_pools, 12)) as a,
        ):
            assert a.put_pages(TOKENS, transfers(SRC)).stored_pages == PAGES
            raw = list(a.lookup(TOKENS).keys)
            backed = a.backup(raw, wait=True)
            assert backed.stored_pages == backed.queued_pages
    finally:
        first.stop()
    second = start(l3)  # an empty L2 in front of the same L3
    try:
        with HiCacheClient(second.target, timeout_s=30) as client:
            pools_a = pools_of(worker_pools, None)
            with (
                attach(client, "tenant-b", pools_of(worker_pools, None)) as b,
                attach(client, "tenant-a", pools_a) as a,
            ):
                for keys in (TOKENS, raw):
                    assert b.lookup(keys).total_hit_pages == 0
                    assert b.get_pages(keys, transfers(DST), include_l3=True).hit_pages == 0
                assert a.lookup(raw).total_hit_pages == PAGES
                assert a.get_pages(raw, transfers(DST), include_l3=True).hit_pages == PAGES
                with HiCacheClient(second.admin_target, timeout_s=10) as admin:
                    cleared = admin.clear_namespace(MODEL, "tenant-a")
                assert cleared.l2_pages == PAGES, "the fetched pages are tenant A's"
                assert a.lookup(raw).l2_hit_pages == 0
    finally:
        second.stop()


def attach_small(client: HiCacheClient, worker_pools: list[WorkerPools], tenant: str) -> Session:
    """A session whose pools share one group of ``PAGES`` host pages with every other such session."""
    identity = WorkerIdentity(unique_tag("tn"), generation=1, model_name=MODEL, tenant=tenant)
    return client.attach(
        identity, pools_of(worker_pools, len(worker_pools)).specs(host_ratio=PAGES / DEVICE_PAGES)
    )


def test_a_put_skips_every_cached_key_and_evicts_no_other_tenants_pages(
    l3: Path, worker_pools: list[WorkerPools]
) -> None:
    """Before: only a leading run of cached keys was skipped; a cached key later in the list got
    a host page (evicting tenant B's oldest entry from the full pool) and a copy, both thrown
    away when the index refused the key at publish."""
    daemon = start(l3)
    try:
        with (
            HiCacheClient(daemon.target, timeout_s=30) as client,
            attach_small(client, worker_pools, "tenant-b") as b,
            attach_small(client, worker_pools, "tenant-a") as a,
        ):
            keys = [f"b{i}" for i in range(PAGES - 2)]
            assert b.put_pages(keys, transfers(SRC[: PAGES - 2])).stored_pages == PAGES - 2
            assert a.put_pages(["a0"], transfers([0])).stored_pages == 1  # one host page left
            put = a.put_pages(["a1", "a0"], transfers([1, 2]))
            assert (put.stored_pages, put.existing_pages) == (1, 1)
            assert b.lookup(keys).l2_hit_pages == PAGES - 2
            assert a.lookup(["a0", "a1"]).l2_hit_pages == 2
    finally:
        daemon.stop()


def test_a_refused_put_of_a_repeated_key_evicts_no_other_tenants_pages(
    l3: Path, worker_pools: list[WorkerPools]
) -> None:
    """Before: the put allocated its two host pages (evicting two of tenant B's eight entries
    from the full pool) and copied into them before the index refused the repeated key."""
    daemon = start(l3)
    try:
        with (
            HiCacheClient(daemon.target, timeout_s=30) as client,
            attach_small(client, worker_pools, "tenant-b") as b,
            attach_small(client, worker_pools, "tenant-a") as a,
        ):
            keys = [f"b{i}" for i in range(PAGES)]
            assert b.put_pages(keys, transfers(SRC)).stored_pages == PAGES
            before = admin_state(daemon)
            with pytest.raises(HiCacheError) as refused:
                a.put_pages(["x", "x"], transfers([0, 1]))
            assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert "'x' is listed more than once" in refused.value.message
            assert b.lookup(keys).l2_hit_pages == PAGES
            assert admin_state(daemon) == before
    finally:
        daemon.stop()


CLAIM = """
import sys
from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity, pool_spec
target = sys.argv[1]
spec = pool_spec("kv", role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1,
                 num_heads=2, head_dim=16, k_buffers=[], host_bytes=1 << 20)
with HiCacheClient(target) as c:
    for tenant in sys.argv[2:]:
        try:
            c.attach(WorkerIdentity("claim-" + tenant, 1, "m-claim", tenant=tenant), [spec], heartbeat=False).detach()
            print(tenant, "ATTACHED")
        except HiCacheError as e:
            print(tenant, e.code.name, e.message)
"""


def test_a_reserved_tenant_is_only_attached_from_its_uids() -> None:
    """Before ``sessions.tenant_uids`` any uid on the node could name another user's tenant at
    attach and read its pages (a reviewer's uid 65534 read root's page of tenant ``team-a``)."""
    other = other_user()
    daemon = start_daemon(
        "--set", "server.socket_mode=0o666",
        "--set", f"sessions.tenant_uids=team-a=12345;team-c={other}",
    )  # fmt: skip
    try:
        with HiCacheClient(daemon.target, timeout_s=30) as client:
            proc = run_as_other(CLAIM, daemon.target, "team-a", "team-b", "team-c")
            assert proc.returncode == 0, proc.stderr[-2000:]
            answers = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
            assert answers["team-a"].startswith("PERMISSION_DENIED"), answers
            assert "sessions.tenant_uids" in answers["team-a"] and f"uid {other}" in answers["team-a"]
            assert answers["team-b"] == "ATTACHED" and answers["team-c"] == "ATTACHED", answers
            # root may use any tenant (it can read the pools' shared memory anyway)
            identity = WorkerIdentity(unique_tag("tn"), generation=1, model_name="m-claim", tenant="team-a")
            spec = pool_spec(
                "kv", role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1, num_heads=2,
                head_dim=16, k_buffers=[], host_bytes=1 << 20,
            )  # fmt: skip
            client.attach(identity, [spec], heartbeat=False).detach()
    finally:
        daemon.stop()


@pytest.mark.parametrize("tenant", ["", "tenant-a"], ids=["default-tenant", "named-tenant"])
def test_a_workers_clear_removes_its_pages_that_left_l2_for_l3(l3: Path, tenant: str) -> None:
    """Before: the L3 copies of the default tenant's keys were never remembered, so its
    worker's ClearNamespace deleted only those still in L2 and the evicted ones stayed
    servable from L3 after a clear that answered success."""
    # 8 host pages of 512 bytes
    spec = pool_spec(
        "kv", role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1, num_heads=2,
        head_dim=16, k_buffers=[], host_bytes=8 * 512,
    )  # fmt: skip
    daemon = start(l3)
    try:
        with HiCacheClient(daemon.target, timeout_s=30) as client:
            identity = WorkerIdentity(unique_tag("tc"), 1, MODEL, tenant=tenant)
            with client.attach(identity, [spec], heartbeat=False) as s:
                s.put_bytes([PageBytes("victim", "kv", bytes(range(256)) * 2)])
                s.backup(["victim"], wait=True)
                for i in range(16):  # twice the pool: the victim leaves L2, kept in L3
                    s.put_bytes([PageBytes(f"filler-{i}", "kv", bytes(512))])
                    s.backup([f"filler-{i}"], wait=True)
                found = s.lookup(["victim"])
                assert (found.l2_hit_pages, found.total_hit_pages) == (0, 1)

                client.clear_namespace(MODEL, session_id=s.session_id, session_secret=s.info.session_secret)

                found = s.lookup(["victim"])
                assert (found.l2_hit_pages, found.total_hit_pages) == (0, 0)
                assert s.get_bytes(["victim"], include_l3=True).pages == ()
    finally:
        daemon.stop()
