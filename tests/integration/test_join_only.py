"""Attach with ``join_only``: join the pool group of a model and layout if the daemon has it,
else NOT_FOUND and nothing created. What ``hicached lookup`` uses now that a worker's GetStats
shows no pool groups (it checked the group there first). Real daemon, public client."""

from __future__ import annotations

import uuid

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity

from tests.robustness.loop_support import byte_spec
from tests.support.state import snapshot


def _identity(model: str) -> WorkerIdentity:
    return WorkerIdentity(f"join-{uuid.uuid4().hex[:8]}", 1, model)


def test_join_only_creates_no_group(client: HiCacheClient, admin: HiCacheClient) -> None:
    model = f"m-nobody-{uuid.uuid4().hex[:6]}"
    before = snapshot(admin.get_stats())
    with pytest.raises(HiCacheError) as info:
        client.attach(_identity(model), [byte_spec()], heartbeat=False, join_only=True)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert "no pool group of model" in info.value.message and "join_only" in info.value.message
    assert snapshot(admin.get_stats()) == before, "no group, no host memory, no session"


def test_join_only_joins_an_existing_group(client: HiCacheClient) -> None:
    model = f"m-joined-{uuid.uuid4().hex[:6]}"
    first = client.attach(_identity(model), [byte_spec()], heartbeat=False)
    try:
        # A smaller host size joins the group (as `hicached lookup` asks for a few pages).
        joined = client.attach(_identity(model), [byte_spec(pages=2)], heartbeat=False, join_only=True)
        try:
            assert joined.info.joined_existing_group
            (group,) = joined.stats().groups
            assert group.model_name == model and group.sessions == 2
        finally:
            joined.detach()
    finally:
        first.detach()


def test_join_only_does_not_recreate_a_smaller_group(client: HiCacheClient, admin: HiCacheClient) -> None:
    """A group too small for the request would be recreated larger (it is idle); with
    join_only it is NOT_FOUND, and the group stays as it was."""
    model = f"m-small-{uuid.uuid4().hex[:6]}"
    client.attach(_identity(model), [byte_spec(pages=2)], heartbeat=False).detach()  # now idle
    before = snapshot(admin.get_stats())
    with pytest.raises(HiCacheError) as info:
        client.attach(_identity(model), [byte_spec(pages=8)], heartbeat=False, join_only=True)
    assert info.value.code == grpc.StatusCode.NOT_FOUND, info.value
    assert "join_only" in info.value.message
    assert snapshot(admin.get_stats()) == before
