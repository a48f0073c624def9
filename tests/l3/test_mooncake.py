"""The ``mooncake`` backend against a real ``mooncake_master`` and a
``mooncake_client`` segment host on loopback (TCP transport): layout,
verification, staging rounds, a full store, configuration and failures.

Fixtures: ``test_mooncake_fixtures.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from mooncake.store import MooncakeDistributedStore

from hicached.errors import InvalidArgument, Unavailable
from hicached.l3 import StorageBackend, create_backend
from hicached.l3.framing import frame
from hicached.l3.mooncake import MooncakeBackend
from hicached.testing.procs import free_ports
from hicached.testing.servers import MooncakeMaster, mooncake_master

from .test_mooncake_fixtures import mc_options


@pytest.fixture
def raw(mooncake_srv: MooncakeMaster) -> Iterator[Any]:
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 << 20, "tcp", "", mooncake_srv.master_addr) == 0
    yield store
    store.close()


def _mc(backend: StorageBackend) -> MooncakeBackend:
    assert isinstance(backend, MooncakeBackend)
    return backend


def test_values_are_frames_under_the_key_prefix(mooncake_backend: StorageBackend, raw: Any) -> None:
    backend = _mc(mooncake_backend)
    assert backend.set(["model/tp0/p1"], [b"p" * 1000]) == [True]
    name = backend.config.key_prefix + "model/tp0/p1"
    assert raw.get(name) == frame("model/tp0/p1", [b"p" * 1000])
    assert raw.is_exist("model/tp0/p1") == 0


def test_corrupt_pages_are_misses_counted_and_removed(mooncake_backend: StorageBackend, raw: Any) -> None:
    backend = _mc(mooncake_backend)
    prefix = backend.config.key_prefix
    good = frame("c/a", [b"a" * 1000])
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    assert raw.put(prefix + "c/a", bytes(flipped)) == 0
    assert raw.put(prefix + "c/b", good[:20]) == 0  # truncated
    assert raw.put(prefix + "c/c", good) == 0  # a whole frame, but of another key
    before = backend.stats()
    assert backend.get(["c/a", "c/b"]) == [None, None]
    assert backend.get_into(["c/c"], [[memoryview(bytearray(1000))]]) == [False]
    after = backend.stats()
    assert after.corrupt_pages - before.corrupt_pages == 3
    assert after.misses - before.misses == 3
    assert backend.exists(["c/a"]) == 0  # removed, so it can be stored again
    assert backend.set(["c/a"], [b"a" * 1000]) == [True]
    assert backend.get(["c/a"]) == [b"a" * 1000]


def test_pages_outlive_the_backend_in_the_segment_host(mooncake_srv: MooncakeMaster) -> None:
    options = mc_options(mooncake_srv)
    first = create_backend("mooncake", options)
    assert first.set(["o/a", "o/b"], [b"1" * 64, b"2" * 64]) == [True, True]
    first.close()
    second = create_backend("mooncake", options)
    try:
        assert second.exists(["o/a", "o/b"]) == 2
        assert second.get(["o/a", "o/b"]) == [b"1" * 64, b"2" * 64]
        assert second.clear() == 2
    finally:
        second.close()


def test_key_prefixes_isolate_and_clear_touches_only_ours(mooncake_srv: MooncakeMaster) -> None:
    a = create_backend("mooncake", mc_options(mooncake_srv))
    b = create_backend("mooncake", mc_options(mooncake_srv))
    try:
        assert a.set(["k"], [b"from a"]) == [True]
        assert b.exists(["k"]) == 0
        assert b.set(["k"], [b"from b"]) == [True]
        assert a.clear() == 1
        assert b.get(["k"]) == [b"from b"]
    finally:
        b.clear()
        a.close()
        b.close()


def test_batches_larger_than_staging_go_in_rounds(mooncake_srv: MooncakeMaster) -> None:
    backend = create_backend("mooncake", mc_options(mooncake_srv, staging_bytes=64 << 10))
    try:
        keys = [f"r/{i}" for i in range(40)]
        values = [os.urandom(10_000) for _ in keys]  # ~6 frames per round
        assert backend.set(keys, values) == [True] * 40
        dests = [bytearray(10_000) for _ in keys]
        assert backend.get_into(keys, [[memoryview(d)] for d in dests]) == [True] * 40
        assert [bytes(d) for d in dests] == values
        assert backend.get(keys) == values
    finally:
        backend.clear()
        backend.close()


def test_get_of_pages_larger_than_any_seen_before(mooncake_srv: MooncakeMaster) -> None:
    options = mc_options(mooncake_srv, staging_bytes=1 << 20)
    writer = create_backend("mooncake", options)
    reader = create_backend("mooncake", options)  # has seen no page yet: slots of 64 KiB
    try:
        values = [os.urandom(200_000), os.urandom(10), os.urandom(300_000)]
        assert writer.set(["big/0", "big/1", "big/2"], values) == [True] * 3
        assert reader.get(["big/0", "big/1", "big/2", "big/none"]) == [*values, None]
    finally:
        writer.clear()
        writer.close()
        reader.close()


def test_page_larger_than_staging_raises_and_writes_nothing(mooncake_srv: MooncakeMaster) -> None:
    backend = create_backend("mooncake", mc_options(mooncake_srv, staging_bytes=8192))
    try:
        with pytest.raises(InvalidArgument, match="staging_bytes=8192"):
            backend.set(["small", "huge"], [b"x", b"y" * 9000])
        assert backend.exists(["small"]) == 0
        with pytest.raises(InvalidArgument, match="'huge'"):
            backend.get_into(["huge"], [[memoryview(bytearray(9000))]])
    finally:
        backend.close()


def test_a_full_store_fails_puts_without_raising() -> None:
    with mooncake_master(segment_bytes=16 << 20) as srv:
        backend = create_backend("mooncake", mc_options(srv))
        try:
            keys = [f"full/{i}" for i in range(40)]
            values = [os.urandom(1 << 20) for _ in keys]
            ok = backend.set(keys, values)
            assert not all(ok)  # 40 MiB does not fit 16 MiB
            stored = [k for k, good in zip(keys, ok, strict=True) if good]
            assert backend.stats().pages == len(stored)
            pages = backend.get(keys)
            for key, value, page in zip(keys, values, pages, strict=True):
                assert page is None or page == value, key  # evicted or intact, never wrong
        finally:
            backend.close()


def test_backend_can_lend_its_own_segment() -> None:
    with mooncake_master(segment_bytes=0) as srv:
        backend = create_backend("mooncake", mc_options(srv, global_segment_bytes=16 << 20))
        try:
            assert backend.set(["own"], [b"mine"]) == [True]
            assert backend.get(["own"]) == [b"mine"]
            assert backend.stats().pages == 1
        finally:
            backend.close()


def test_unreachable_master_is_unavailable_at_start() -> None:
    (port,) = free_ports(1)
    with pytest.raises(Unavailable, match=f"127.0.0.1:{port}"):
        create_backend("mooncake", {"master_addr": f"127.0.0.1:{port}", "connect_timeout_s": 0.5})


def test_stats_fail_while_the_master_is_down() -> None:
    """Fails before (a review of stop 46): stats answered the backend's own counters without
    asking the master, so `hicached status` showed a healthy L3 while every put failed. Now
    the master must answer a probe."""
    with mooncake_master() as srv:
        backend = create_backend("mooncake", mc_options(srv))
        try:
            assert backend.set(["up"], [b"x"]) == [True]
            assert backend.stats().pages == 1
            os.kill(srv.pid, signal.SIGKILL)
            with pytest.raises(Unavailable, match=f"mooncake master {srv.master_addr} does not answer"):
                backend.stats()
        finally:
            backend.close()


def test_closed_backend_is_unavailable(mooncake_srv: MooncakeMaster) -> None:
    backend = create_backend("mooncake", mc_options(mooncake_srv))
    backend.close()
    backend.close()  # idempotent
    for call in (
        lambda: backend.get(["x"]),
        lambda: backend.set(["x"], [b"x"]),
        lambda: backend.get_into(["x"], [[memoryview(bytearray(1))]]),
        lambda: backend.exists(["x"]),
        lambda: backend.delete(["x"]),
        backend.clear,
        backend.stats,
    ):
        with pytest.raises(Unavailable, match="closed"):
            call()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"master_addr": "localhost"}, "'master_addr'.*'localhost'"),
        ({"master_addr": "h:0"}, "'master_addr'.*'h:0'"),
        ({"master_addr": "h:1", "protocol": "udp"}, "'protocol'.*'udp'"),
        ({"master_addr": "h:1", "staging_bytes": 100}, "'staging_bytes'.*100"),
        ({"master_addr": "h:1", "replicas": 0}, "'replicas'.*0"),
        ({"master_addr": "h:1", "global_segment_bytes": -1}, "'global_segment_bytes'.*-1"),
        ({"master_addr": "h:1", "connect_timeout_s": 0}, "'connect_timeout_s'"),
        ({"master_addr": "h:1", "segment": 1}, "unknown option"),
        ({}, "needs option"),
    ],
)
def test_bad_config_is_rejected_with_the_offending_value(options: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        create_backend("mooncake", options)


def test_missing_library_gives_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes the import raise ImportError, as on a machine without Mooncake.
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(InvalidArgument, match=r"pip install 'hicached\[mooncake\]'"):
        create_backend("mooncake", {"master_addr": "127.0.0.1:1"})


_CLOSE_UNDER_A_CALL = """
import os, signal, sys, threading
from hicached.l3 import create_backend
from hicached.testing.servers import mooncake_master
from tests.l3.test_mooncake_fixtures import mc_options
from tests.support.state import poll

def in_native_call(thread):
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code.co_name == "exists" and "batch_is_exist" in (
        open(frame.f_code.co_filename).read().splitlines()[frame.f_lineno - 1])

with mooncake_master(segment_bytes=16 << 20) as srv:
    backend = create_backend("mooncake", mc_options(srv))
    assert backend.set(["a"], [b"x" * 100]) == [True]
    os.killpg(os.getpgid(srv.pid), signal.SIGSTOP)  # the master stalls: exists() waits in it
    try:
        found = []
        caller = threading.Thread(target=lambda: found.append(backend.exists(["a"])))
        caller.start()
        poll(lambda: in_native_call(caller), bool, 10.0, "exists() inside the native client")
        closer = threading.Thread(target=backend.close)
        closer.start()
    finally:
        os.killpg(os.getpgid(srv.pid), signal.SIGCONT)
    caller.join()
    closer.join()
    print("exists", found)
"""


def test_close_waits_for_a_call_in_flight_instead_of_crashing_the_process() -> None:
    """close() under an exists() that waits on a stalled master: the native client was closed
    under the call, and the process died of SIGSEGV when the master answered. Now close()
    waits for the call, which returns its answer. In a child process: the old code kills it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _CLOSE_UNDER_A_CALL],
        cwd=root,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -11: SIGSEGV
    assert "exists [1]" in done.stdout
