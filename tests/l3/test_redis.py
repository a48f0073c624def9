"""The ``redis`` backend against a real redis-server: verification, prefixes, failures."""

from __future__ import annotations

import pytest
import redis

from hicached.errors import InvalidArgument, Unavailable
from hicached.l3 import StorageBackend, create_backend
from hicached.l3.framing import frame
from hicached.testing.procs import free_ports
from hicached.testing.servers import RedisServer, redis_server


@pytest.fixture
def raw(redis_srv: RedisServer) -> redis.Redis:
    return redis.Redis(host=redis_srv.host, port=redis_srv.port)


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


def test_a_destination_of_another_size_is_a_counted_miss(redis_backend: StorageBackend) -> None:
    assert redis_backend.set(["s/a"], [b"a" * 1000]) == [True]
    before = redis_backend.stats()
    assert redis_backend.get_into(["s/a"], [[memoryview(bytearray(999))]]) == [False]
    after = redis_backend.stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (0, 1)


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
