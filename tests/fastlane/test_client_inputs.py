"""What a worker hands the client, with and without the fast lane: the same refusals before
anything is sent, the same answers for any sequence of keys, and a close under way that
fails the op instead of touching the lane's closed descriptors (reviews of stop 47)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import numpy as np
import pytest
from hicached_client import (
    AsyncHiCacheClient,
    ClientClosedError,
    HiCacheClient,
    HiCacheError,
    Session,
    Transfer,
    WorkerIdentity,
)

from tests.fastlane.conftest import free_pages
from tests.robustness.loop_support import FakeRedis, fake_l3_daemon
from tests.support.daemon import Daemon
from tests.support.kv import WorkerPools

NOT_INTEGERS = {
    "float-array": np.array([1.7, 2.9]),
    "float-list": [1.5],
    "bool-list": [True, False],
    "int-and-bool": [1, True],
    "bool-array": np.array([True]),
    "past-int64": np.array([2**63], dtype=np.uint64),
    "numpy-bool-in-list": [np.True_, 1],
    "list-past-int64": [-1, 2**63],
    "list-past-uint64": [2**64],
}


def _attach(client: Any, pools: WorkerPools) -> Any:
    return client.attach(WorkerIdentity(f"i-{uuid.uuid4().hex[:8]}", 1, "m-fastlane"), pools.specs())


def _lane_open(session: Session) -> bool:
    return session._slot._lane is not None


@pytest.mark.parametrize("bad", NOT_INTEGERS.values(), ids=NOT_INTEGERS.keys())
def test_page_indices_that_are_not_integers_are_refused_alike_before_anything_is_sent(
    daemon: Daemon, pools: WorkerPools, bad: Any
) -> None:
    """Fails before: the lane cast them (1.7 -> 1, True -> 1, 2**63 -> a negative index) and
    copied other pages than the caller named, where gRPC refuses them."""
    refused: list[type[BaseException]] = []
    for fast in (False, True):
        with HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=fast) as client:
            session = _attach(client, pools)
            session.release_transfers(list(session.resolve_transfers([Transfer("kv", [1])]).transfers))
            assert _lane_open(session) is fast
            before = free_pages(session)
            with pytest.raises((TypeError, ValueError)) as wrote:
                session.write([Transfer("kv", bad)], allocate=True)
            with pytest.raises((TypeError, ValueError)) as loaded:
                session.load_wait([Transfer("kv", [1, 2][: len(bad)], bad)])
            refused += [type(wrote.value), type(loaded.value)]
            assert free_pages(session) == before, "nothing was allocated or copied"
            assert _lane_open(session) is fast, "a refusal before sending leaves the lane as it was"
            session.close()
    assert refused[:2] == refused[2:], refused


def test_keys_given_as_an_iterator_are_answered_alike_with_and_without_the_lane(
    daemon: Daemon, pools: WorkerPools
) -> None:
    """Fails before: the keys were read for the lane also when the session sent the call over
    gRPC, which then sent none (a Lookup of a cached prefix found nothing; a put was refused)."""
    keys = [uuid.uuid4().hex for _ in range(3)]
    answers = []
    for fast in (False, True):
        with HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=fast) as client:
            session = _attach(client, pools)
            if not fast:
                stored = session.put_pages(
                    iter(keys), [Transfer("kv", [1, 2, 3]), Transfer("draft", [1, 2, 3])]
                )
                assert stored.stored_pages == 3, stored
            found = session.lookup(iter(keys))
            got = session.get_pages(iter(keys), [Transfer("kv", [5, 6, 7]), Transfer("draft", [5, 6, 7])])
            answers.append((found.l2_hit_pages, list(found.keys), got.hit_pages))
            session.close()
    assert answers == [(3, keys, 3)] * 2, answers


def test_closing_an_async_client_under_a_lane_op_fails_the_op_as_closed(pools: WorkerPools) -> None:
    """Fails before: the lane's descriptors were closed on a thread while an op still waited on
    them, so the op read a closed descriptor (``OSError(EBADF)``; had its number been reused,
    another file) or never woke. Now the close wakes it first: it fails as closed."""

    async def main(daemon: Daemon, fake: FakeRedis) -> None:
        client = AsyncHiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True)
        session = await _attach(client, pools)
        assert (await session.lookup([uuid.uuid4().hex])).total_hit_pages == 0  # opens the lane
        assert session._slot._lane is not None
        fake.hang()
        op = asyncio.create_task(
            session.get_pages(
                [uuid.uuid4().hex], [Transfer("kv", [1]), Transfer("draft", [1])], include_l3=True
            )
        )
        await asyncio.to_thread(fake.wait_unanswered, 1, 30)  # the op waits on L3 in the daemon
        await client.close()
        done, _ = await asyncio.wait([op], timeout=10)
        assert done, "the op ended"
        assert not op.cancelled() and isinstance(op.exception(), ClientClosedError), op.exception()

    with fake_l3_daemon() as (daemon, fake):
        asyncio.run(main(daemon, fake))


def test_closing_a_lane_right_after_an_op_was_sent_fails_the_op_at_once(pools: WorkerPools) -> None:
    """Fails before (a review of stop 47): an op sent but not yet waiting (its wait registers a
    moment later, on the loop) was not woken by the close, which then waited for the op to
    end on its own (its whole timeout, 8 s here; for ever without one)."""

    async def main(daemon: Daemon, fake: FakeRedis) -> None:
        client = AsyncHiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True)
        session = await _attach(client, pools)
        await session.lookup([uuid.uuid4().hex])  # opens the lane
        lane = session._slot._lane
        assert lane is not None
        fake.hang()
        sent = lane.lane._tail
        op = asyncio.create_task(lane.get_pages([uuid.uuid4().hex], _both([1]), include_l3=True, timeout_s=8))
        for _ in range(10_000):  # loop turns, no clock: until the record is in the ring
            if lane.lane._tail > sent:
                break
            await asyncio.sleep(0)
        assert lane.lane._tail > sent and lane._woke is None, "sent, not yet waiting"
        await lane.close()  # directly: a task around it would let the op's wait register first
        done, _ = await asyncio.wait([op], timeout=4)
        assert done and isinstance(op.exception(), HiCacheError), op
        # Before: the close waited out the op's 8 s and the op ended DEADLINE_EXCEEDED.
        assert op.exception().code == grpc.StatusCode.UNAVAILABLE  # type: ignore[union-attr]
        await client.close()

    with fake_l3_daemon() as (daemon, fake):
        asyncio.run(main(daemon, fake))


def _both(pages: list[int]) -> list[Transfer]:
    return [Transfer("kv", pages), Transfer("draft", pages)]
