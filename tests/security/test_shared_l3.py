"""A writer of a shared L3 (redis) forging a tenant's pages; ``l3.auth_key_file``.

Attack (reviewer, on main, real redis-server and daemon): a process that can write the redis
several daemons share computed tenant ``alice``'s object names from the public tenant tag (or
read them off the keys already there) and SET a plain frame of its own bytes (0x41) under a
page alice had not stored yet; GetPages with include_l3 copied those bytes into alice's device
pool, and SET NX would have kept the forgery for good.

Now, with ``l3.auth_key_file``: frames carry an HMAC of key and payload and tenant tags are
keyed, so a forgery is a miss (removed from redis) and alice's pool keeps its own bytes. On
main these tests fail at the first start: ``l3.auth_key_file`` is an unknown key (exit 2).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from hicached_client import HiCacheClient, Session, WorkerIdentity

from hicached.core.tenants import tenant_tag
from hicached.l3.framing import FRAME_HEADER, FrameCodec, L3Key, frame
from hicached.testing.servers import RedisServer, redis_server
from tests.security.roles_helpers import one_line_error, serve
from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import POOLS, WorkerPools, transfers, unique_tag

MODEL = "m-shared-l3"
SRC, DST = 1, 2  # device pages: alice's own page, and where GetPages copies to
A = b"\x41"  # the attacker's bytes


def plain(real: bytes) -> int:
    """The payload of a plain frame as long as ``real`` (an authenticated frame)."""
    return len(real) - FRAME_HEADER.size


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
def raw(redis_srv: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(host=redis_srv.host, port=redis_srv.port)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def secrets(tmp_path: Path) -> tuple[Path, Path]:
    """Two key files, as two deployments would make them (one with a final newline)."""
    first, second = tmp_path / "l3-key-a", tmp_path / "l3-key-b"
    first.write_text(os.urandom(48).hex() + "\n")
    second.write_bytes(os.urandom(48))
    for path in (first, second):
        path.chmod(0o600)
    return first, second


def start(redis_srv: RedisServer, key_file: Path | None) -> Daemon:
    key = ["--set", f"l3.auth_key_file={key_file}"] if key_file is not None else []
    return start_daemon("--l3", "redis", "--set", f"l3.redis.port={redis_srv.port}", *key)


def attach(client: HiCacheClient, worker_pools: list[WorkerPools], tenant: str, seed: int | None) -> Session:
    pools = WorkerPools.create(unique_tag("sl3"))
    worker_pools.append(pools)
    pools.fill_random(seed) if seed is not None else pools.clobber()
    return client.attach(WorkerIdentity(unique_tag("sl3"), 1, MODEL, tenant=tenant), pools.specs())


def digests(pools: WorkerPools, page: int) -> dict[str, str]:
    return {name: pools.digest(name, [page]) for name in POOLS}


def names_of(raw: redis.Redis, key: str) -> dict[str, str]:
    """Pool -> the redis name of ``key``'s page in that pool (``hicached/<group>/<pool>/<key>``)."""
    found = {}
    for name in (n.decode() for n in raw.scan_iter(match="hicached/*")):
        _root, _group, pool, rest = name.split("/", 3)
        if rest == key or rest.startswith(key + "~"):
            found[pool] = name
    return found


def test_a_page_forged_in_a_shared_redis_is_never_served(
    redis_srv: RedisServer, raw: redis.Redis, secrets: tuple[Path, Path], worker_pools: list[WorkerPools]
) -> None:
    daemon = start(redis_srv, secrets[0])
    try:
        with (
            HiCacheClient(daemon.target, timeout_s=30) as client,
            attach(client, worker_pools, "alice", 7) as s,
        ):
            pools = worker_pools[-1]
            assert s.put_pages(["legit"], transfers([SRC])).stored_pages == 1
            backed = s.backup(["legit"], wait=True)
            assert backed.stored_pages == backed.queued_pages
            legit = names_of(raw, "legit")
            assert sorted(legit) == sorted(POOLS)
            tag = legit["kv"].rpartition("~")[2]
            assert tag != tenant_tag("alice"), "alice's tag must not be the public one"

            def forged(victim: str, with_tag: str) -> dict[str, str]:
                return {p: n.replace(f"/legit~{tag}", f"/{victim}~{with_tag}") for p, n in legit.items()}

            wrong = FrameCodec(L3Key.from_secret(secrets[1].read_bytes()).frame_key)
            # Each forgery has the length of alice's real value, so the length check does not
            # stop it: the plain ones carry 16 more payload bytes (their header is 16 shorter).
            attacks: dict[str, tuple[dict[str, str], Callable[[str, bytes], bytes]]] = {
                # The reviewer's attack: the public tag, a plain frame of the attacker's bytes.
                "public-tag": (
                    forged("v1", tenant_tag("alice")),
                    lambda n, real: frame(n, [A * plain(real)]),
                ),
                # The real tag read off the keys, a plain frame.
                "plain": (forged("v2", tag), lambda n, real: frame(n, [A * plain(real)])),
                # The real tag, an authenticated frame under another key.
                "wrong-key": (forged("v3", tag), lambda n, real: wrong.frame(n, [A * (len(real) - 48)])),
                # Alice's own valid frame replayed under another page's name.
                "replay": (forged("v4", tag), lambda n, real: real),
            }
            for names, make in attacks.values():
                for pool, name in names.items():
                    real = raw.get(legit[pool])
                    assert isinstance(real, bytes)
                    raw.set(name, make(name, real))
            before = digests(pools, DST)
            for what, (names, _make) in attacks.items():
                victim = names["kv"].rpartition("/")[2].partition("~")[0]
                got = s.get_pages([victim], transfers([DST]), include_l3=True)
                assert got.hit_pages == 0, what
                assert digests(pools, DST) == before, f"{what}: forged bytes reached alice's pool"
                if what != "public-tag":  # read and refused: removed, so alice's own write is stored
                    assert raw.exists(*names.values()) == 0, what
            log = daemon.log
            assert "unauthenticated frame (version 1)" in log and "MAC mismatch" in log
            # Alice's own page is intact.
            assert s.get_pages(["legit"], transfers([DST]), include_l3=True).hit_pages == 1
            assert digests(pools, DST) == digests(pools, SRC)
    finally:
        daemon.stop()


def test_daemons_sharing_an_l3_need_the_same_key(
    redis_srv: RedisServer, raw: redis.Redis, secrets: tuple[Path, Path], worker_pools: list[WorkerPools]
) -> None:
    """The same key file on two daemons: one's pages are the other's hits (the tag and the MAC
    are the same). Another key, or none: every read a miss (logged, counted, removed), no crash."""
    first = start(redis_srv, secrets[0])
    try:
        with HiCacheClient(first.target, timeout_s=30) as client:
            for tenant in ("alice", ""):
                with attach(client, worker_pools, tenant, 3) as s:
                    keys = [f"{tenant or 'default'}-{i}" for i in range(3)]
                    assert s.put_pages(keys, transfers([SRC, SRC + 1, SRC + 2])).stored_pages == 3
                    backed = s.backup(keys, wait=True)
                    assert backed.stored_pages == backed.queued_pages
        written = digests(worker_pools[-1], SRC)
    finally:
        first.stop()

    def read(daemon: Daemon, tenant: str, key: str) -> tuple[int, dict[str, str]]:
        with (
            HiCacheClient(daemon.target, timeout_s=30) as client,
            attach(client, worker_pools, tenant, None) as s,
        ):
            hit = s.get_pages([key], transfers([DST]), include_l3=True).hit_pages
            return hit, digests(worker_pools[-1], DST)

    same = start(redis_srv, secrets[0])
    try:
        assert read(same, "alice", "alice-0")[0] == 1
        assert read(same, "", "default-0") == (1, written)
    finally:
        same.stop()

    stored = raw.dbsize()
    other = start(redis_srv, secrets[1])
    try:
        assert read(other, "alice", "alice-1")[0] == 0  # another tag: its names are not even found
        assert read(other, "", "default-1")[0] == 0  # the same names: the MAC fails
        assert "MAC mismatch" in other.log
    finally:
        other.stop()
    assert raw.dbsize() == stored - len(POOLS), "the mismatched frames were removed"

    keyless = start(redis_srv, None)
    try:
        assert read(keyless, "", "default-2")[0] == 0
        assert "this daemon has no l3.auth_key_file" in keyless.log
        assert "Traceback" not in keyless.log
    finally:
        rc = keyless.stop()
    assert rc == 0, "a daemon without the key met authenticated frames and did not stop cleanly"


@pytest.mark.parametrize(
    ("content", "says"),
    [(None, "cannot read"), (b"\n", "empty"), (b"k" * 31 + b"\n", "31 bytes")],
    ids=["missing", "empty", "short"],
)
def test_a_bad_key_file_stops_startup_naming_the_key(
    tmp_path: Path, content: bytes | None, says: str
) -> None:
    path = tmp_path / f"key-{uuid.uuid4().hex[:8]}"
    if content is not None:
        path.write_bytes(content)
    socket = tmp_path / "d.sock"
    line = one_line_error(serve("--socket", str(socket), "--set", f"l3.auth_key_file={path}"))
    assert line.startswith("hicached: configuration error: l3.auth_key_file = "), line
    assert says in line and "kkkk" not in line, "the secret is not echoed"
    assert not socket.exists()
