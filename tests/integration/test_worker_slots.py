"""A worker slot (instance id, TP and PP rank) is a name any client may claim: claiming it must
never end, or lock out, a session another client attached. Real daemon, real gRPC."""

from __future__ import annotations

import uuid

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity

from tests.robustness.loop_support import byte_spec
from tests.support.daemon import Daemon
from tests.support.state import state


def test_another_tenant_cannot_end_a_session_by_attaching_its_slot(daemon: Daemon) -> None:
    instance = f"worker-{uuid.uuid4().hex[:6]}"
    with HiCacheClient(daemon.target) as alice, HiCacheClient(daemon.target) as mallory:
        victim = alice.attach(
            WorkerIdentity(instance, 1, "m-slot", tenant="alice"), [byte_spec()], heartbeat=False
        )
        before = state(alice)
        with pytest.raises(HiCacheError) as err:
            mallory.attach(
                WorkerIdentity(instance, 2, "m-slot", tenant="mallory"), [byte_spec()], heartbeat=False
            )
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "attached in another tenant; only that tenant may replace it" in err.value.message
        assert state(alice) == before
        assert victim.heartbeat() > 0
        # Its own tenant, from the same peer, still replaces it (a restarted worker).
        newer = alice.attach(
            WorkerIdentity(instance, 2, "m-slot", tenant="alice"), [byte_spec()], heartbeat=False
        )
        assert newer.info.replaced_session_id == victim.session_id
        newer.detach()


def test_an_ended_session_leaves_no_claim_on_its_slot(daemon: Daemon) -> None:
    """Before: the highest generation ever seen was kept per slot, forever. A client could attach
    "worker-0" with generation 2**64-1 and detach, and every real attach of it was refused as
    stale until the daemon restarted; and each fresh instance id added an entry for good."""
    instance = f"worker-{uuid.uuid4().hex[:6]}"
    with HiCacheClient(daemon.target) as squatter, HiCacheClient(daemon.target) as worker:
        squatter.attach(
            WorkerIdentity(instance, (1 << 64) - 1, "m-slot"), [byte_spec()], heartbeat=False
        ).detach()
        session = worker.attach(WorkerIdentity(instance, 1, "m-slot"), [byte_spec()], heartbeat=False)
        session.detach()


def test_a_stale_generation_is_refused_while_the_newer_session_lives(daemon: Daemon) -> None:
    instance = f"worker-{uuid.uuid4().hex[:6]}"
    with HiCacheClient(daemon.target) as client:
        current = client.attach(WorkerIdentity(instance, 5, "m-slot"), [byte_spec()], heartbeat=False)
        with pytest.raises(HiCacheError) as err:
            client.attach(WorkerIdentity(instance, 4, "m-slot"), [byte_spec()], heartbeat=False)
        assert (
            err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            and "stale generation 4" in err.value.message
        )
        current.detach()
