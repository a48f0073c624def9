"""Issue 9 item 4: admin is a role.

Attacks tried on main (each test fails there): any client of the socket, or a
TCP client with the worker token, could Drain the daemon and ClearNamespace any
model or tenant; GetStats listed every session id, identity, backup and the
daemon's shared-memory segment names to anyone.

Now the admin role is the admin socket (its file mode: a second uid cannot even
connect) or the admin token on TCP; everyone else gets PERMISSION_DENIED naming
the admin socket, nothing changes, and GetStats shows aggregates only.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Session, Stats, TokenChain, WorkerIdentity

from tests.robustness.loop_support import byte_spec
from tests.security.roles_helpers import connect_as, launch, other_user, scratch_dir
from tests.security.users import run_as_other
from tests.support.daemon import ROOT, Daemon
from tests.support.kv import PAGE_SIZE, WorkerPools, transfers, unique_tag
from tests.support.state import snapshot

WORKER_TOKEN = "worker-token-roles"
ADMIN_TOKEN = "admin-token-roles"
MODEL = "m-roles"
PAGES = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Setup:
    def __init__(self, daemon: Daemon, tcp: str, session: Session, keys: TokenChain) -> None:
        self.daemon, self.tcp, self.session, self.keys = daemon, tcp, session, keys

    @property
    def admin_socket(self) -> str:
        return self.daemon.admin_target.removeprefix("unix://")

    def admin_state(self) -> dict[str, Any]:
        with HiCacheClient(self.daemon.admin_target, timeout_s=10) as admin:
            stats = admin.get_stats()
        return {**snapshot(stats), "draining": stats.draining}


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    workdir = scratch_dir()
    (workdir / "worker.token").write_text(WORKER_TOKEN)
    (workdir / "admin.token").write_text(ADMIN_TOKEN)
    port = free_port()
    daemon = launch(
        workdir,
        "--listen", f"127.0.0.1:{port}",
        "--set", f"server.auth_token_file={workdir / 'worker.token'}",
        "--set", f"server.admin_token_file={workdir / 'admin.token'}",
        "--set", "server.socket_mode=0o666",  # any uid may be a worker: the role split is the admin socket
    )  # fmt: skip
    pools = WorkerPools.create(unique_tag("roles"))
    pools.fill_random(7)
    try:
        with HiCacheClient(daemon.target, timeout_s=30) as client:
            identity = WorkerIdentity(unique_tag("roles"), generation=1, model_name=MODEL, tenant="t-roles")
            with client.attach(identity, pools.specs()) as session:
                keys = TokenChain(list(range(PAGES * PAGE_SIZE)))
                assert session.put_pages(keys, transfers(range(PAGES))).stored_pages == PAGES
                backup = session.retract_backup("req-roles", transfers([10, 11]), 2 * PAGE_SIZE)
                assert backup.ok
                yield Setup(daemon, f"127.0.0.1:{port}", session, keys)
    finally:
        pools.close()
        daemon.stop()


ADMIN_CALLS: dict[str, Callable[[HiCacheClient], object]] = {
    "Drain": lambda c: c.drain(wait_flush=True),
    "Resume": lambda c: c.resume(),
    "ClearNamespace": lambda c: c.clear_namespace(MODEL),
    "ClearNamespace-tenant": lambda c: c.clear_namespace(MODEL, "t-roles"),
}


def _worker_clients(setup: Setup) -> dict[str, HiCacheClient]:
    return {
        "worker socket": HiCacheClient(setup.daemon.target, timeout_s=10),
        "tcp worker token": HiCacheClient(setup.tcp, token=WORKER_TOKEN, timeout_s=10),
    }


@pytest.mark.parametrize("call", list(ADMIN_CALLS))
@pytest.mark.parametrize("via", ["worker socket", "tcp worker token"])
def test_admin_rpcs_from_a_worker_are_permission_denied_and_change_nothing(
    setup: Setup, call: str, via: str
) -> None:
    before = setup.admin_state()
    client = _worker_clients(setup)[via]
    with client, pytest.raises(HiCacheError) as info:
        ADMIN_CALLS[call](client)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    if via == "worker socket":
        assert f"admin socket {setup.admin_socket}" in info.value.message
    else:  # a TCP caller may be off the node: it is told the token, not the node's path
        assert "admin token" in info.value.message
        assert setup.admin_socket not in info.value.message
    assert setup.admin_state() == before
    assert setup.session.lookup(setup.keys).l2_hit_pages == PAGES, "the pages are still cached"


def test_a_worker_clears_only_its_own_tenant(setup: Setup) -> None:
    """ClearNamespace from a worker names its session and cannot reach another tenant or model."""
    before = setup.admin_state()
    with HiCacheClient(setup.daemon.target, timeout_s=10) as client:
        for model, tenant in ((MODEL, "someone-else"), ("m-other", "")):
            with pytest.raises(HiCacheError) as info:
                client.clear_namespace(
                    model,
                    tenant,
                    session_id=setup.session.session_id,
                    session_secret=setup.session.info.session_secret,
                )
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED, (model, tenant)
            assert "secret" not in info.value.message, "refused for the tenant, not for a missing secret"
    assert setup.admin_state() == before


def _hides_everything_private(stats: Stats) -> None:
    assert stats.sessions == () and stats.backups == ()
    # No pool group either: each named its model, and showed its indexed pages and sessions.
    assert stats.groups == (), [g.model_name for g in stats.groups]
    assert stats.host_used_bytes > 0, "aggregates stay"


def test_getstats_shows_a_worker_aggregates_only(setup: Setup) -> None:
    """Before: any client read every session id (a capability then) and the pool segment names;
    and, until the pool groups were hidden too, every group's model name, indexed pages and
    session count (this test asserted those were shown)."""
    for client in _worker_clients(setup).values():
        with client:
            _hides_everything_private(client.get_stats())
            with pytest.raises(HiCacheError) as info:
                client.get_stats(setup.session.session_id)  # the id alone is no capability
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    own = setup.session.stats()  # with the session's secret: its own view
    (mine,) = own.sessions
    assert mine.session_id == setup.session.session_id and len(own.backups) == 1
    (group,) = own.groups  # its own group, segment names hidden
    assert group.group == mine.group and group.model_name == MODEL and group.indexed_pages == PAGES
    assert all(p.segment == "" for p in group.pools)


STRANGER = """
import json, sys
from hicached_client import HiCacheClient
with HiCacheClient(sys.argv[1], timeout_s=30) as c:
    st = c.get_stats()
    print(json.dumps({"sessions": len(st.sessions), "models": [g.model_name for g in st.groups],
                      "indexed": sum(g.indexed_pages for g in st.groups), "used": st.host_used_bytes}))
"""


def test_a_stranger_sees_no_tenants_pool_group(setup: Setup) -> None:
    """A reviewer's repro: another uid, with no session at all, read every pool group of every
    tenant from GetStats (model 'team-b-secret-model', its indexed pages, its sessions)."""
    proc = run_as_other(STRANGER, setup.daemon.target)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (seen["sessions"], seen["models"], seen["indexed"]) == (0, [], 0), seen
    assert seen["used"] > 0, "the daemon's aggregates stay"


def test_a_worker_sees_its_own_group_and_no_other(setup: Setup) -> None:
    with HiCacheClient(setup.daemon.target, timeout_s=10) as client:
        identity = WorkerIdentity(unique_tag("own"), generation=1, model_name="m-own", tenant="t-own")
        session = client.attach(identity, [byte_spec()], heartbeat=False)
        try:
            own = session.stats()
            assert [g.model_name for g in own.groups] == ["m-own"], "not the other tenant's m-roles"
            assert [s.session_id for s in own.sessions] == [session.session_id]
            assert client.get_stats().groups == (), "without naming its session: no group"
        finally:
            session.detach()


def test_a_worker_counts_only_its_tenant_in_its_shared_group(setup: Setup) -> None:
    """Groups are per model and layout, not per tenant: before, a worker's own view of its group
    counted every tenant's indexed pages and sessions (another tenant's cache activity)."""
    pools = WorkerPools.create(unique_tag("co-tenant"))
    try:
        with HiCacheClient(setup.daemon.target, timeout_s=10) as client:
            identity = WorkerIdentity(unique_tag("co"), generation=1, model_name=MODEL, tenant="t-other")
            with client.attach(identity, pools.specs(), heartbeat=False) as other:
                (group,) = other.stats().groups
                (theirs,) = setup.session.stats().groups
                assert group.group == theirs.group, "the same model and layout share one group"
                assert (group.indexed_pages, group.sessions) == (0, 1), "its own tenant only"
                assert (theirs.indexed_pages, theirs.sessions) == (PAGES, 1)
                with HiCacheClient(setup.daemon.admin_target, timeout_s=10) as admin:
                    (full,) = [g for g in admin.get_stats().groups if g.group == group.group]
                assert (full.indexed_pages, full.sessions) == (PAGES, 2), "the admin sees everyone"
    finally:
        pools.close()


@pytest.mark.parametrize("via", ["admin socket", "tcp admin token"])
def test_the_admin_role_sees_everything_and_drains(setup: Setup, via: str) -> None:
    target, token = (setup.daemon.admin_target, None) if via == "admin socket" else (setup.tcp, ADMIN_TOKEN)
    with HiCacheClient(target, token=token, timeout_s=10) as admin:
        stats = admin.get_stats()
        assert [s.session_id for s in stats.sessions] == [setup.session.session_id]
        assert stats.sessions[0].identity.tenant == "t-roles"
        assert len(stats.backups) == 1 and all(p.segment for g in stats.groups for p in g.pools)
        admin.drain()
        assert admin.get_stats().draining
        assert admin.resume() is True
        assert not admin.get_stats().draining


def test_tcp_without_a_token_is_unauthenticated(setup: Setup) -> None:
    with HiCacheClient(setup.tcp, timeout_s=10) as client, pytest.raises(HiCacheError) as info:
        client.drain()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_second_uid_cannot_connect_to_the_admin_socket(setup: Setup) -> None:
    uid, gid = other_user()
    assert connect_as(uid, gid, Path(setup.admin_socket)) == errno.EACCES
    assert connect_as(uid, gid, Path(setup.daemon.target.removeprefix("unix://"))) == 0, (
        "the same uid reaches the worker socket (mode 0666 here), so the refusal is the admin socket's"
    )


def test_hicached_status_uses_the_admin_socket_by_default(setup: Setup) -> None:
    """With only the worker socket named ($HICACHED_SOCKET), status reads the admin socket next to it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    env["HICACHED_SOCKET"] = setup.daemon.target.removeprefix("unix://")
    shown = subprocess.run(
        [sys.executable, "-m", "hicached", "status", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert [s["session_id"] for s in json.loads(shown.stdout)["sessions"]] == [setup.session.session_id]
