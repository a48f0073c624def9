"""Every proto method is served, built and called: the "Adding an RPC" checklist as a test.

For each method of both services (read from the generated descriptor, so a new rpc in
the .proto is picked up without editing this file) there must be: a servicer method of
that name, a builder in ``hicached_client/_calls.py`` that names it, a method of the
snake_case name on the client or its session, in both the sync and the asyncio client, and
an entry in the lane table (``hicached.server.lanes.RPC_LANES``) that the servicer method uses.
See docs/architecture.md, "Adding an RPC".
"""

from __future__ import annotations

import inspect
import re

import pytest
from hicached_client import _calls, aio, sync
from hicached_client.v1 import hicached_pb2

from hicached.server.lanes import RPC_LANES, Where
from hicached.server.servicer import AdminServicer, CacheServicer

SERVICERS = {"HiCacheService": CacheServicer, "AdminService": AdminServicer}
METHODS = [
    (service.name, method.name)
    for service in hicached_pb2.DESCRIPTOR.services_by_name.values()
    for method in service.methods
]


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_both_services_are_covered() -> None:
    assert {s for s, _ in METHODS} == set(SERVICERS)
    assert len(METHODS) > 20


@pytest.mark.parametrize(("service", "method"), METHODS)
def test_the_servicer_implements_it(service: str, method: str) -> None:
    impl = getattr(SERVICERS[service], method, None)
    assert impl is not None and (inspect.iscoroutinefunction(impl) or inspect.isasyncgenfunction(impl)), (
        f"{service}.{method} has no servicer"
    )
    for klass in SERVICERS[service].__mro__:
        if method in vars(klass):
            assert not klass.__name__.endswith("ServiceServicer"), (
                f"{service}.{method}: only the generated stub"
            )
            break


@pytest.mark.parametrize(("service", "method"), METHODS)
def test_a_client_call_builds_it(service: str, method: str) -> None:
    source = inspect.getsource(_calls)
    assert re.search(rf'Call\(\s*"{method}"', source), (
        f"no builder in hicached_client/_calls.py names {method!r}"
    )
    if service == "AdminService":
        assert re.search(rf'Call\(\s*"{method}".*Service\.ADMIN', source), (
            f"{method} is not sent to AdminService"
        )


@pytest.mark.parametrize(
    "client", [(sync.HiCacheClient, sync.Session), (aio.AsyncHiCacheClient, aio.AsyncSession)]
)
@pytest.mark.parametrize(("service", "method"), METHODS)
def test_both_clients_offer_it(service: str, method: str, client: tuple[type, type]) -> None:
    name = _snake(method)
    aliases = {"get_stats": ("get_stats", "stats")}.get(name, (name,))
    assert any(hasattr(cls, alias) for cls in client for alias in aliases), (
        f"{client[0].__name__} and {client[1].__name__} have no method {name!r} for {service}.{method}"
    )


def test_the_lane_table_names_exactly_the_proto_methods() -> None:
    assert set(RPC_LANES) == {m for _, m in METHODS}


@pytest.mark.parametrize(("service", "method"), METHODS)
def test_the_servicer_runs_where_the_table_says(service: str, method: str) -> None:
    """Its core call goes through ``offload`` under its own name (so the table decides the
    lane); only Ping, which calls nothing, offloads nothing."""
    source = inspect.getsource(getattr(SERVICERS[service], method))
    named = re.findall(r'(?:offload|stream_layers)\(\s*"(\w+)"', source)
    assert set(named) <= {method}, f"{method} offloads under another RPC's name: {named}"
    if method != "Ping":
        assert named, f"{method} runs its core call without offload (RPC_LANES[{method!r}] unused)"
    else:
        assert RPC_LANES[method] is Where.LOOP


def test_the_table_picks_the_lane() -> None:
    """A placement resolves to the lane the table means: page bookkeeping stays on the loop
    (an allocation never waits for L3); COPY_OR_L3 follows the call."""
    from hicached.config import Config
    from hicached.server.lanes import Lanes

    lanes = Lanes.from_config(Config())
    try:
        assert lanes.lane_for(Where.LOOP, l3=True) is None
        assert lanes.lane_for(Where.PAGES, l3=True) is None
        assert lanes.lane_for(Where.COPY_OR_L3, l3=False) is lanes.copy
        assert lanes.lane_for(Where.COPY_OR_L3, l3=True) is lanes.l3
        assert lanes.lane_for(Where.COPY, l3=True) is lanes.copy
        assert lanes.lane_for(Where.L3, l3=False) is lanes.l3
        assert lanes.lane_for(Where.BOOKKEEPING, l3=False) is lanes.bookkeeping
        assert lanes.lane_for(Where.ALLOC, l3=False) is lanes.alloc
    finally:
        lanes.shutdown()
