"""The ``redis`` backend against a real redis-server: verification, prefixes, failures."""

from __future__ import annotations

import pytest
import redis

from hicached.errors import InvalidArgument, Unavailable
from hicached.l3 import StorageBackend, create_backend
from hicached.l3.framing import FRAME_HEADER, frame
from hicached.testing.procs import free_ports
from hicached.testing.servers import RedisServer, redis_server


@pytest.fixture
def raw(redis_srv: RedisServer) -> redis.Redis:
    return redis.Redis(host=redis_srv.host, port=redis_srv.port)


def sent_bytes(raw: redis.Redis) -> int:
    """Bytes the server has sent to all its clients so far (INFO stats); the session's server
    has no other client at work while a test runs."""
    return int(raw.info("stats")["total_net_output_bytes"])


def test_values_are_verified_frames(redis_backend: StorageBackend, raw: redis.Redis) -> None:
    assert all(redis_backend.set(["v/a", "v/b", "v/c"], [b"a" * 1000, b"b" * 1000, b"c" * 1000]))
    stored = raw.get("v/a")
    assert isinstance(stored, bytes)
    assert stored == frame("v/a", [b"a" * 1000])
    corrupt = bytearray(stored)
    corrupt[-1] ^= 0xFF
    raw.set("v/a", bytes(corrupt))
    raw.set("v/b", stored[:20])  # truncated frame
    raw.set("v/c", stored)  # a whole frame, but of another key
    dest = bytearray(1000)
    assert redis_backend.get(["v/a", "v/b", "v/c"]) == [None, None, None]
    assert redis_backend.stats().corrupt_pages == 3
    # Removed once found bad: a set (NX) of the key can store it again (before, the bad value
    # stayed, every set of the key "succeeded" on it and every get missed, for good).
    assert raw.exists("v/a", "v/b", "v/c") == 0
    assert redis_backend.get_into(["v/a"], [[memoryview(dest)]]) == [False]
    assert redis_backend.set(["v/a"], [b"a" * 1000]) == [True]
    assert redis_backend.get_into(["v/a"], [[memoryview(dest)]]) == [True] and dest == b"a" * 1000


def test_a_value_of_another_type_is_a_counted_miss_removed_so_the_page_can_be_stored(
    redis_backend: StorageBackend, raw: redis.Redis
) -> None:
    """Another program's hash, list or set under a page's name. Before, it stayed for good: EXISTS
    found the page, every get missed (MGET answers nil for it) and every set "succeeded" on it."""
    assert redis_backend.set(["t/ok"], [b"o" * 1000]) == [True]
    raw.hset("t/a", "field", "value")
    raw.rpush("t/b", "item")
    before = redis_backend.stats()
    dest = bytearray(1000)
    assert redis_backend.get_into(["t/a"], [[memoryview(dest)]]) == [False]
    assert redis_backend.get(["t/ok", "t/b", "t/none"]) == [b"o" * 1000, None, None]
    after = redis_backend.stats()
    assert (after.corrupt_pages - before.corrupt_pages, after.misses - before.misses) == (2, 3)
    assert raw.exists("t/a", "t/b") == 0
    assert redis_backend.set(["t/a", "t/b"], [b"a" * 1000, b"b" * 1000]) == [True, True]
    assert redis_backend.get_into(["t/a"], [[memoryview(dest)]]) == [True] and dest == b"a" * 1000
    assert redis_backend.get(["t/b"]) == [b"b" * 1000]


def test_a_destination_of_another_size_is_a_counted_miss(
    redis_backend: StorageBackend, raw: redis.Redis
) -> None:
    """The value is of another size than the destination's frame: corrupt, and removed (the
    daemon's L3 names carry its pools' layouts, so its own pages always fit)."""
    assert redis_backend.set(["s/a"], [b"a" * 1000]) == [True]
    before = redis_backend.stats()
    assert redis_backend.get_into(["s/a"], [[memoryview(bytearray(999))]]) == [False]
    after = redis_backend.stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (0, 1)
    assert (after.corrupt_pages - before.corrupt_pages, raw.exists("s/a")) == (1, 0)


def test_a_foreign_oversized_value_is_a_corrupt_miss_never_read_whole(
    redis_backend: StorageBackend, raw: redis.Redis
) -> None:
    """64 MiB that another program stored under a 4 KiB page's name. Before, MGET sent all of it
    to the daemon (which held it whole) before the frame check refused it; now the server sends
    at most one byte past the page's frame, and the value is a corrupt miss, removed."""
    assert redis_backend.set(["big/ok"], [b"o" * 4096]) == [True]
    raw.set("big/a", b"\xa5" * (64 << 20))
    before = redis_backend.stats()
    dests = [bytearray(4096), bytearray(4096)]
    sent = sent_bytes(raw)
    assert redis_backend.get_into(["big/a", "big/ok"], [[memoryview(d)] for d in dests]) == [False, True]
    sent = sent_bytes(raw) - sent
    assert sent < 64 << 10, f"the server sent {sent} bytes for two 4 KiB pages"
    assert dests[1] == b"o" * 4096
    after = redis_backend.stats()
    assert (after.corrupt_pages - before.corrupt_pages, after.misses - before.misses) == (1, 1)
    assert raw.exists("big/a") == 0
    assert redis_backend.set(["big/a"], [b"a" * 4096]) == [True]
    assert redis_backend.get_into(["big/a"], [[memoryview(dests[0])]]) == [True] and dests[0] == b"a" * 4096


@pytest.mark.parametrize("extra", [1, -1], ids=["one-byte-long", "one-byte-short"])
def test_a_value_of_another_size_than_the_frame_is_a_corrupt_miss_removed(
    redis_backend: StorageBackend, raw: redis.Redis, extra: int
) -> None:
    """A well-formed frame of this very key, one byte longer or shorter than the page asked
    for. Before, it verified, missed as a destination of another size, was not counted as
    corrupt and stayed (every set of the key "succeeded" on it, every read missed)."""
    raw.set("one/a", frame("one/a", [b"f" * (4096 + extra)]))
    before = redis_backend.stats()
    dest = bytearray(4096)
    assert redis_backend.get_into(["one/a"], [[memoryview(dest)]]) == [False]
    after = redis_backend.stats()
    assert (after.corrupt_pages - before.corrupt_pages, after.misses - before.misses) == (1, 1)
    assert raw.exists("one/a") == 0
    assert redis_backend.set(["one/a"], [b"a" * 4096]) == [True]
    assert redis_backend.get_into(["one/a"], [[memoryview(dest)]]) == [True] and dest == b"a" * 4096


def test_an_empty_string_is_a_corrupt_miss_removed(redis_backend: StorageBackend, raw: redis.Redis) -> None:
    """GETRANGE answers an empty string as it answers a missing key; the empty one is still
    found, counted and removed (by the request a batch with a miss makes)."""
    raw.set("empty/a", b"")
    before = redis_backend.stats()
    assert redis_backend.get_into(["empty/a", "empty/none"], [[memoryview(bytearray(10))]] * 2) == [False] * 2
    assert redis_backend.get(["empty/a"]) == [None]
    after = redis_backend.stats()
    assert (after.corrupt_pages - before.corrupt_pages, after.misses - before.misses) == (1, 3)
    assert raw.exists("empty/a") == 0


def test_get_reads_no_value_past_max_value_bytes(redis_srv: RedisServer, raw: redis.Redis) -> None:
    """``get`` knows no page size; it reads a value up to max_value_bytes, the largest frame
    set stores. Before, the option did not exist and get read any value whole."""
    most = 1 << 20
    backend = create_backend(
        "redis", {"host": redis_srv.host, "port": redis_srv.port, "max_value_bytes": most}
    )
    try:
        edge = b"e" * (most - FRAME_HEADER.size)
        assert backend.set(["mv/edge", "mv/over"], [edge, edge + b"!"]) == [True, False]
        assert raw.exists("mv/edge", "mv/over") == 1  # the page whose frame is over was not stored
        raw.set("mv/big", b"\x5a" * (16 << 20))
        before = backend.stats()
        sent = sent_bytes(raw)
        assert backend.get(["mv/big", "mv/edge"]) == [None, edge]
        sent = sent_bytes(raw) - sent
        assert sent < 2 * most + (64 << 10), f"the server sent {sent} bytes for two values of at most 1 MiB"
        after = backend.stats()
        assert (after.corrupt_pages - before.corrupt_pages, after.misses - before.misses) == (1, 1)
        assert raw.exists("mv/big", "mv/edge") == 1
    finally:
        backend.clear("mv/")
        backend.close()


def test_key_prefix_isolation(redis_srv: RedisServer, redis_backend: StorageBackend) -> None:
    a = create_backend("redis", {"port": redis_srv.port, "key_prefix": "tenant-a/"})
    b = create_backend("redis", {"port": redis_srv.port, "key_prefix": "tenant-b/"})
    try:
        assert a.set(["k"], [b"from a"]) == [True]
        assert b.exists(["k"]) == 0
        assert b.set(["k"], [b"from b"]) == [True]
        assert a.get(["k"]) == [b"from a"]
        assert a.clear() == 1
        assert b.get(["k"]) == [b"from b"]
    finally:
        a.close()
        b.close()


def test_ttl_option_sets_expiry(
    redis_srv: RedisServer, redis_backend: StorageBackend, raw: redis.Redis
) -> None:
    backend = create_backend("redis", {"port": redis_srv.port, "ttl_s": 300})
    try:
        assert backend.set(["ttl"], [b"x"]) == [True]
        assert 0 < int(raw.ttl("ttl")) <= 300
    finally:
        backend.close()


def test_unreachable_server_is_unavailable() -> None:
    (port,) = free_ports(1)
    with pytest.raises(Unavailable, match=f"127.0.0.1:{port}"):
        create_backend("redis", {"port": port, "socket_timeout_s": 0.5, "retries": 0})


def test_closed_backend_is_unavailable(redis_srv: RedisServer) -> None:
    backend = create_backend("redis", {"port": redis_srv.port})
    backend.close()
    backend.close()
    with pytest.raises(Unavailable, match="closed"):
        backend.get(["x"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"port": 0}, "'port' must be in 1..65535"),
        ({"port": "6379"}, "'port' of storage backend 'redis' = '6379': expected an integer"),
        ({"batch_pages": 0}, "'batch_pages' must be > 0"),
        ({"max_value_bytes": 31}, "'max_value_bytes' must be >= 32"),
        ({"hots": "x"}, "unknown option"),
    ],
)
def test_bad_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        create_backend("redis", options)


def test_a_read_only_replica_is_unavailable_not_an_internal_error() -> None:
    """A failover demotes the server under the daemon: its READONLY refusals are Unavailable
    (retryable, and a clear reads as not done), not a raw redis error (INTERNAL)."""
    with redis_server() as srv:
        backend = create_backend("redis", {"host": srv.host, "port": srv.port})
        raw = redis.Redis(host=srv.host, port=srv.port)
        try:
            assert backend.set(["r/a"], [b"x" * 100]) == [True]
            raw.execute_command("REPLICAOF", "127.0.0.1", "1")  # now a read-only replica
            with pytest.raises(Unavailable, match="ReadOnlyError"):
                backend.delete(["r/a"])
            with pytest.raises(Unavailable, match="ReadOnlyError"):
                backend.clear("r/")
        finally:
            raw.execute_command("REPLICAOF", "NO", "ONE")
            backend.close()


def test_stats_count_this_prefix_only(redis_srv: RedisServer) -> None:
    """Daemons sharing one database under their own key_prefix each count their own pages.
    Before, each reported the whole database (DBSIZE): 3, 6, then 9 pages for three daemons."""
    backends = [
        create_backend(
            "redis", {"host": redis_srv.host, "port": redis_srv.port, "key_prefix": f"{p}-{id(redis_srv)}/"}
        )
        for p in ("a", "b", "c")
    ]
    try:
        for backend in backends:
            assert backend.set(["k1", "k2", "k3"], [b"x" * 1000, b"y" * 2000, b"z" * 3000]) == [True] * 3
        for backend in backends:
            stats = backend.stats()
            assert (stats.pages, stats.bytes) == (3, 6000)
    finally:
        for backend in backends:
            backend.clear("")
            backend.close()


def test_stats_skip_a_value_of_another_type_under_the_prefix(
    redis_srv: RedisServer, raw: redis.Redis
) -> None:
    """Another program's hash under this daemon's prefix. Before, STRLEN's refusal of it failed
    every stats refresh (Unavailable) for as long as it stayed: no page counts for any page."""
    prefix = f"st-{id(raw)}/"
    backend = create_backend("redis", {"host": redis_srv.host, "port": redis_srv.port, "key_prefix": prefix})
    try:
        assert backend.set(["k1", "k2"], [b"x" * 1000, b"y" * 2000]) == [True, True]
        raw.hset(prefix + "foreign", "field", "value")
        stats = backend.stats()
        assert (stats.pages, stats.bytes) == (2, 3000)
    finally:
        backend.clear("")
        backend.close()
