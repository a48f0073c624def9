"""The fast lane moves the same bytes and answers the same results as gRPC."""

from __future__ import annotations

import uuid
from dataclasses import replace

import grpc
import pytest
from hicached_client import HiCacheError, Transfer

from tests.fastlane.conftest import Worker, free_pages
from tests.support.kv import PAGE_SIZE

PAGES = 64


def test_write_then_load_through_the_lane_is_byte_exact(worker: Worker) -> None:
    pools, lane = worker.pools, worker.lane
    pools.fill_random(21)
    src = list(range(PAGES))
    dst = list(range(500, 500 + PAGES))
    expected = {n: pools.pages(n, src).clone() for n in ("kv", "draft")}
    free_before = free_pages(worker.session)
    w = lane.write([Transfer("kv", src), Transfer("draft", src)], allocate=True)
    assert w.ok
    assert {t.pool: t.host_allocated for t in w.transfers} == {"kv": True, "draft": True}
    assert {a.pool: (a.pages, a.tokens) for a in w.acks} == {
        "kv": (PAGES, PAGES * PAGE_SIZE),
        "draft": (PAGES, PAGES * PAGE_SIZE),
    }
    assert {p: free_before[p] - n for p, n in free_pages(worker.session).items()} == {
        "kv": PAGES,
        "draft": PAGES,
    }
    pools.clobber()
    r = lane.load([Transfer(t.pool, dst, t.host_pages) for t in w.transfers])
    assert set(r.layers) == {0, 1}
    assert {a.pool: a.bytes for a in r.acks} == {a.pool: a.bytes for a in w.acks}
    for name in ("kv", "draft"):
        assert bool((pools.pages(name, dst) == expected[name]).all()), (
            f"{name} pages differ after the lane load"
        )
        assert bool((pools.pages(name, src) == -1).all()), f"{name}: the load wrote outside its destination"
    freed = lane.release_transfers(list(w.transfers))
    assert freed == 2 * PAGES
    assert free_pages(worker.session) == free_before


def test_lane_and_grpc_give_equal_results_and_equal_errors(worker: Worker) -> None:
    lane, session = worker.lane, worker.session
    worker.pools.fill_random(22)
    via_lane = lane.write([Transfer("kv", [1, 2, 3])], allocate=True)
    via_grpc = session.write([Transfer("kv", [1, 2, 3])], allocate=True)
    assert via_lane.ok and via_grpc.ok
    assert via_lane.acks == via_grpc.acks
    assert [t.device_pages for t in via_lane.transfers] == [t.device_pages for t in via_grpc.transfers]
    # A write into host pages the lane allocated, through gRPC, and back: both paths see one ledger.
    host = via_lane.transfers[0].host_pages
    assert session.write([Transfer("kv", [7, 8, 9], host)]).ok
    assert (
        lane.load([Transfer("kv", [10, 11, 12], host)]).acks
        == session.load_wait([Transfer("kv", [13, 14, 15], host)]).acks
    )
    for bad in (
        [Transfer("kv", [-1])],
        [Transfer("kv", [5000])],
        [Transfer("nope", [1])],
        [Transfer("kv", [1, 1])],
    ):
        with pytest.raises(HiCacheError) as on_lane:
            lane.write(bad, allocate=True)
        with pytest.raises(HiCacheError) as on_grpc:
            session.write(bad, allocate=True)
        assert on_lane.value.code == on_grpc.value.code != grpc.StatusCode.OK
        assert on_lane.value.message == on_grpc.value.message
    assert lane.release_transfers(list(via_lane.transfers)) == 3
    assert session.release_transfers(list(via_grpc.transfers)) == 3


def test_resolve_and_op_id_replay_through_the_lane(worker: Worker) -> None:
    lane = worker.lane
    before = free_pages(worker.session)["kv"]
    first = lane.resolve_transfers([Transfer("kv", [1, 2])], op_id="resolve-1")
    again = lane.resolve_transfers([Transfer("kv", [1, 2])], op_id="resolve-1")
    assert first.ok and first == again, "a retried op_id must return the first answer"
    assert free_pages(worker.session)["kv"] == before - 2
    with pytest.raises(HiCacheError) as err:
        lane.resolve_transfers([Transfer("kv", [3])], op_id="resolve-1")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert lane.release_transfers(list(first.transfers)) == 2


def test_each_layer_is_published_in_the_ring_before_the_completion(worker: Worker) -> None:
    lane = worker.lane
    w = lane.write([Transfer("kv", [1, 2])], allocate=True)
    pending = lane.start_load([Transfer("kv", [3, 4], w.transfers[0].host_pages)])
    landed = [pending.wait_layer(layer) for layer in (0, 1)]
    result = pending.result(timeout_s=30)
    assert result.layers == (0, 1)
    assert all(ns > 0 for ns in landed) and landed[0] <= landed[1]
    assert pending.layer_landed(0) and pending.layer_landed(1)
    lane.release_transfers(list(w.transfers))


def test_a_worker_can_sleep_on_the_layer_doorbell_instead_of_spinning(worker: Worker) -> None:
    lane = worker.lane
    w = lane.write([Transfer("kv", [1, 2])], allocate=True)
    pending = lane.start_load([Transfer("kv", [3, 4], w.transfers[0].host_pages)])
    assert pending.wait_layer(1, spin=False) > 0
    assert pending.result(timeout_s=30).layers == (0, 1)
    lane.release_transfers(list(w.transfers))


def test_keyed_pages_through_the_lane_are_byte_exact_and_replay_like_grpc(worker: Worker) -> None:
    lane, session, pools = worker.lane, worker.session, worker.pools
    pools.fill_random(44)
    keys = [uuid.uuid4().hex for _ in range(PAGES)]
    src, dst = list(range(PAGES)), list(range(200, 200 + PAGES))
    expected = {n: pools.pages(n, src).clone() for n in ("kv", "draft")}
    both = [Transfer("kv", src), Transfer("draft", src)]
    put = lane.put_pages(keys, both, op_id="keyed-1")
    assert (put.ok, put.stored_pages, put.existing_pages) == (True, PAGES, 0)
    assert lane.put_pages(keys, both, op_id="keyed-1") == put, "a retried op_id returns the first answer"
    assert session.put_pages(keys, both) == replace(put, stored_pages=0, existing_pages=PAGES, acks=())
    with pytest.raises(HiCacheError) as on_lane:
        lane.put_pages(keys[:1], [Transfer("kv", src[:1]), Transfer("draft", src[:1])], op_id="keyed-1")
    assert on_lane.value.code == grpc.StatusCode.INVALID_ARGUMENT and "already used" in on_lane.value.message
    pools.clobber()
    got = lane.get_pages(keys, [Transfer("kv", dst), Transfer("draft", dst)])
    assert (
        got.hit_pages == PAGES
        and got.acks == session.get_pages(keys, [Transfer("kv", dst), Transfer("draft", dst)]).acks
    )
    for name, want in expected.items():
        assert bool((pools.pages(name, dst) == want).all()), f"{name}: the pages read back differ"
    probe = [*keys[:3], uuid.uuid4().hex, *keys[3:]]
    assert lane.lookup(probe) == session.lookup(probe), "a lane Lookup answers as the gRPC one"
    assert lane.lookup(probe).l2_hit_pages == 3
