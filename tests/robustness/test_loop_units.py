"""Issue 10, the mechanisms on their own (the daemon-level tests are test_loop_stalls.py and
test_loop_limits.py): the L3 stats cache under a hung backend, a lane's bounded queue, the
per-peer session count, clipping of client values, errno -> status. All new on this branch."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import threading

import grpc
import pytest

from hicached.config import Config
from hicached.core.types import PeerCred
from hicached.errors import LimitExceeded, clip
from hicached.l3.base import BackendStats
from hicached.l3.stats_cache import StatsCache
from hicached.server.lanes import Lane, Lanes
from hicached.server.peers import Buffers, PeerSessions, peer_key
from hicached.server.status import status_for

STATS = BackendStats(pages=3, bytes=30, capacity_bytes=0, hits=1, misses=2, corrupt_pages=0, evicted_pages=0)


class HungBackend:
    """stats() blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def stats(self) -> BackendStats:
        self.calls += 1
        self.release.wait(30)
        return STATS


def test_stats_cache_answers_within_its_wait_while_the_backend_hangs() -> None:
    backend = HungBackend()
    cache = StatsCache("redis", backend)  # type: ignore[arg-type]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await cache.current(0.1) == ("redis", None, None, "")  # nothing yet, and no hang
        assert await cache.current(0.1) == ("redis", None, None, "")
        assert loop.time() - start < 5.0
        assert backend.calls == 1  # one refresh at a time: the hung one is not repeated
        await cache.step()  # still running: logged and skipped
        assert backend.calls == 1
        backend.release.set()
        name, stats, age, error = await cache.current(5.0)
        assert (name, stats, error) == ("redis", STATS, "") and age is not None and age >= 0

    try:
        asyncio.run(scenario())
    finally:
        backend.release.set()
        cache.close()


def test_a_lane_refuses_calls_beyond_its_queue_naming_the_key() -> None:
    lane = Lane("l3", 1, max_queued=1, key="limits.max_l3_calls_queued")
    gate = threading.Event()

    async def scenario() -> None:
        first = asyncio.ensure_future(lane.run(gate.wait, 30))
        second = asyncio.ensure_future(lane.run(gate.wait, 30))
        await asyncio.sleep(0)  # one loop turn: both tasks ran up to their executor wait
        assert lane.pending == 2
        with pytest.raises(LimitExceeded) as err:
            await lane.run(gate.wait, 30)
        assert err.value.key == "limits.max_l3_calls_queued" and "limits.max_l3_calls_queued=1" in str(
            err.value
        )
        gate.set()
        assert await first and await second
        assert lane.pending == 0
        assert await lane.run(lambda: 7) == 7  # room again

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        lane.shutdown()


def test_a_lane_limits_the_calls_of_one_session_and_counts_them_back() -> None:
    lane = Lane("l3", 3, per_session=1, per_session_key="limits.max_l3_calls_per_session")
    gate = threading.Event()

    async def scenario() -> None:
        first = asyncio.ensure_future(lane.run(gate.wait, 30, session="a"))
        await asyncio.sleep(0)  # one loop turn: the task ran up to its executor wait
        with pytest.raises(LimitExceeded) as err:
            await lane.run(gate.wait, 30, session="a")
        assert err.value.key == "limits.max_l3_calls_per_session"
        assert "limits.max_l3_calls_per_session=1" in str(err.value)
        assert lane.pending == 1  # the refused call was never counted
        other = asyncio.ensure_future(lane.run(gate.wait, 30, session="b"))  # another session
        unnamed = asyncio.ensure_future(lane.run(gate.wait, 30))  # no session: not counted per session
        await asyncio.sleep(0)
        assert lane.pending == 3
        gate.set()
        assert await first and await other and await unnamed
        assert lane.pending == 0
        assert await lane.run(lambda: 7, session="a") == 7  # its call finished: room again

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        lane.shutdown()


@pytest.mark.parametrize(
    ("lane", "key"),
    [
        ("copy", "max_copy_calls_per_session"),
        ("l3", "max_l3_calls_per_session"),
        ("hash", "max_hash_calls_per_session"),
        ("alloc", "max_alloc_calls_per_session"),
    ],
)
def test_the_lanes_take_their_per_session_limit_from_config(lane: str, key: str) -> None:
    """The daemon's lanes as configured: one call of a session in, its second refused naming
    the key, another session's call still in. (The hash lane had no limit: one session's
    concurrent 32 MiB Lookups each held their request, 24 of them 1 GiB.)"""
    cfg = Config()
    cfg = dataclasses.replace(cfg, limits=dataclasses.replace(cfg.limits, **{key: 1}))
    lanes = Lanes.from_config(cfg)
    gate = threading.Event()
    chosen: Lane = getattr(lanes, lane)

    async def scenario() -> None:
        first = asyncio.ensure_future(chosen.run(gate.wait, 30, session="hog"))
        await asyncio.sleep(0)  # one loop turn: the task ran up to its executor wait
        with pytest.raises(LimitExceeded) as err:
            await chosen.run(gate.wait, 30, session="hog")
        assert err.value.key == f"limits.{key}" and f"limits.{key}=1" in str(err.value)
        other = asyncio.ensure_future(chosen.run(gate.wait, 30, session="bystander"))
        await asyncio.sleep(0)
        assert chosen.pending == 2
        gate.set()
        assert await first and await other

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        lanes.shutdown()


def test_peer_sessions_count_live_sessions_and_attaches_under_way() -> None:
    live: set[str] = set()
    peers = PeerSessions(2, 1 << 40, lambda: frozenset(live), mapping_limit=1 << 20)
    peers.reserve("uid:1")
    peers.reserve("uid:1")
    with pytest.raises(LimitExceeded) as err:
        peers.reserve("uid:1")
    assert "limits.max_sessions_per_peer=2" in str(err.value)
    peers.reserve("uid:2")  # another peer has its own count
    live.add("a")
    peers.settle("uid:1", "a")
    peers.settle("uid:1", None)  # a failed attach frees its reservation
    peers.reserve("uid:1")
    live.discard("a")  # the session ended (detach or lease)
    peers.settle("uid:1", None)
    peers.reserve("uid:1")
    peers.reserve("uid:1")


def test_peer_sessions_bound_the_buffer_bytes_a_peer_hands_over() -> None:
    live: set[str] = set()
    peers = PeerSessions(8, 100, lambda: frozenset(live), mapping_limit=1 << 20)
    peers.reserve("uid:1", Buffers(60))
    with pytest.raises(LimitExceeded) as err:
        peers.reserve("uid:1", Buffers(41))  # 60 reserved + 41 > 100, refused and not counted
    assert err.value.key == "limits.max_buffer_bytes_per_peer"
    assert "limits.max_buffer_bytes_per_peer=100" in str(err.value) and "hold 60" in str(err.value)
    peers.reserve("uid:2", Buffers(100))  # another peer has its own bytes
    peers.reserve("uid:1", Buffers(40))
    live.add("a")
    peers.settle("uid:1", "a", Buffers(60))
    peers.settle("uid:1", None, Buffers(40))  # a failed attach gives its bytes back
    with pytest.raises(LimitExceeded):
        peers.reserve("uid:1", Buffers(41))  # the live session still holds its 60
    peers.reserve("uid:1", Buffers(40))
    peers.settle("uid:1", None, Buffers(40))
    live.discard("a")  # the session ended: its bytes are free again
    peers.reserve("uid:1", Buffers(100))


def test_peer_sessions_bound_the_mappings_a_peer_makes() -> None:
    live: set[str] = set()
    peers = PeerSessions(8, 1 << 40, lambda: frozenset(live), mapping_limit=10)
    peers.reserve("uid:1", Buffers(1, 6))
    with pytest.raises(LimitExceeded) as err:
        peers.reserve("uid:1", Buffers(1, 5))  # 6 + 5 > 10, refused and not counted
    assert err.value.key == "limits.max_mappings_per_peer"
    assert "limits.max_mappings_per_peer=10" in str(err.value) and "hold 6" in str(err.value)
    peers.reserve("uid:2", Buffers(1, 10))  # another peer has its own count
    live.add("a")
    peers.settle("uid:1", "a", Buffers(1, 6))
    peers.reserve("uid:1", Buffers(1, 4))
    peers.settle("uid:1", None, Buffers(1, 4))
    live.discard("a")  # the session ended: its mappings are gone
    peers.reserve("uid:1", Buffers(1, 10))


def test_peer_keys_come_from_the_kernel_or_the_transport() -> None:
    assert peer_key(PeerCred(uid=1000, gid=1000, pid=42), "unix:/run/x.sock") == "uid:1000"
    assert peer_key(None, "ipv4:10.0.0.7:51234") == "tcp:10.0.0.7"
    assert peer_key(None, "ipv6:[::1]:51234") == "tcp:[::1]"
    assert peer_key(None, "unix:/run/x.sock") == "unix"


def test_clip_quotes_a_short_prefix_and_names_the_length() -> None:
    assert clip("abc") == "'abc'"
    assert clip("x" * 100_000) == f"{'x' * 32!r}... (100000 chars)"
    raw = b"\xff" * 40
    assert clip(raw) == repr(raw[:32]) + "... (40 bytes)"


@pytest.mark.parametrize("number", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC])
def test_running_out_is_resource_exhausted(number: int) -> None:
    assert status_for(OSError(number, "x")) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_other_os_errors_stay_internal() -> None:
    assert status_for(OSError(errno.ENOENT, "x")) is None
    assert status_for(ValueError("x")) is None


def test_the_hash_lane_bounds_its_queue_from_config() -> None:
    """Calls beyond server.hash_threads + limits.max_hash_calls_queued are refused naming the key."""
    cfg = Config()
    cfg = dataclasses.replace(
        cfg,
        server=dataclasses.replace(cfg.server, hash_threads=1),
        limits=dataclasses.replace(cfg.limits, max_hash_calls_queued=1),
    )
    lanes = Lanes.from_config(cfg)
    gate = threading.Event()

    async def scenario() -> None:
        held = [asyncio.ensure_future(lanes.hash.run(gate.wait, 30, session=f"s{i}")) for i in range(2)]
        await asyncio.sleep(0)  # one loop turn: both reached the lane (one runs, one waits)
        with pytest.raises(LimitExceeded) as err:
            await lanes.hash.run(gate.wait, 30, session="s3")
        assert err.value.key == "limits.max_hash_calls_queued"
        gate.set()
        assert all([await h for h in held])

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        lanes.shutdown()
