"""Joining an existing pool group validates the attach as creating one does, and a worker
asking for a larger host pool than the group has is refused with both sizes named."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Transfer, WorkerIdentity
from hicached_client.export import ShmKVPool

from tests.robustness.state_support import device_pools, no_retry_client, specs, state
from tests.support.daemon import Daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[HiCacheClient]:
    with no_retry_client(daemon.target) as c:
        yield c


@pytest.fixture
def device() -> Iterator[dict[str, ShmKVPool]]:
    with device_pools() as pools:
        yield pools


def _refused(client: HiCacheClient, identity: WorkerIdentity, pools: Any) -> HiCacheError:
    before = state(client)
    with pytest.raises(HiCacheError) as err:
        client.attach(identity, pools, heartbeat=False)
    assert state(client) == before
    return err.value


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"ratio": math.nan}, "host ratio"),
        ({"layer_ids": [0, 0]}, "layer id 0"),
    ],
    ids=["nan-ratio", "duplicate-layer-ids"],
)
def test_a_join_is_validated_like_a_create(
    client: HiCacheClient, device: dict[str, ShmKVPool], change: dict[str, Any], words: str
) -> None:
    """Fails before the fix: a worker joining an existing group skipped these checks."""
    model = f"m-{uuid.uuid4().hex[:8]}"
    first = client.attach(WorkerIdentity(f"a-{model}", 1, model), specs(device, names=("kv",)))
    try:
        error = _refused(
            client, WorkerIdentity(f"b-{model}", 1, model), specs(device, names=("kv",), **change)
        )
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and words in error.message, error
    finally:
        first.close()


def test_tp_rank_at_or_beyond_tp_size_is_refused(client: HiCacheClient, device: dict[str, ShmKVPool]) -> None:
    """Fails before the fix: tp_rank was never checked against tp_size."""
    identity = WorkerIdentity("a", 1, f"m-{uuid.uuid4().hex[:8]}", tp_rank=2, tp_size=2)
    error = _refused(client, identity, specs(device, names=("kv",)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "tp_rank=2" in error.message, error


def test_a_join_asking_for_a_larger_host_pool_is_refused_naming_both_sizes(
    client: HiCacheClient, device: dict[str, ShmKVPool]
) -> None:
    """Fails before the fix: the worker silently joined the old, smaller group (SGLang restarted
    with a bigger host pool: every put then failed with no reason given)."""
    model = f"m-{uuid.uuid4().hex[:8]}"
    first = client.attach(WorkerIdentity(f"a-{model}", 1, model), specs(device, names=("kv",), ratio=0.25))
    try:
        have = first.info.pools[0].total_pages
        error = _refused(
            client, WorkerIdentity(f"b-{model}", 1, model), specs(device, names=("kv",), ratio=0.5)
        )
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION, error
        assert f"with {have}" in error.message and "asks for" in error.message
        smaller = client.attach(
            WorkerIdentity(f"c-{model}", 1, model), specs(device, names=("kv",), ratio=0.125)
        )
        assert smaller.info.joined_existing_group and smaller.info.pools[0].total_pages == have
        smaller.close()
    finally:
        first.close()
    bigger = client.attach(WorkerIdentity(f"d-{model}", 1, model), specs(device, names=("kv",), ratio=0.5))
    try:  # nobody uses the group any more: it is recreated at the new size
        assert bigger.info.pools[0].total_pages > have
    finally:
        bigger.close()


def test_a_refused_recreate_leaves_the_idle_group_and_its_pages(
    client: HiCacheClient, device: dict[str, ShmKVPool]
) -> None:
    """Fails before the fix: a join too large for the idle group closed it (and every page of its
    content index) before the budget refused the larger one, so anyone attaching the same model
    and layout with a huge host ratio, another tenant too, wiped the cached pages."""
    model = f"m-{uuid.uuid4().hex[:8]}"
    owner = WorkerIdentity(f"a-{model}", 1, model)
    keys = [f"{i:064x}" for i in range(1, 5)]
    first = client.attach(owner, specs(device, names=("kv",)), heartbeat=False)
    try:
        assert first.put_pages(keys, [Transfer("kv", [0, 1, 2, 3])]).stored_pages == 4
    finally:
        first.close()
    error = _refused(
        client,
        WorkerIdentity(f"b-{model}", 1, model, tenant="another-tenant"),
        specs(device, names=("kv",), ratio=1e6),
    )
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "host.budget" in error.message, error
    again = client.attach(owner, specs(device, names=("kv",)), heartbeat=False)
    try:
        assert again.info.joined_existing_group
        assert again.lookup(keys).l2_hit_pages == 4
    finally:
        again.close()
