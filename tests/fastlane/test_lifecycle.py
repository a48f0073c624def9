"""Negotiation, limits and teardown of fast lanes against a real daemon."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Transfer, WorkerIdentity
from hicached_client import lane_wire as w
from hicached_client.fastlane import FastLane, lane_path

from tests.fastlane.conftest import Worker
from tests.security.users import other_user, run_as_other
from tests.support.daemon import ROOT, Daemon, start_daemon
from tests.support.kv import WorkerPools, unique_tag
from tests.support.state import fd_links, poll, state, stop_process


def daemon_resources(daemon: Daemon) -> tuple[int, int, int]:
    """What the daemon holds for lanes, from /proc: (lane memfd fds, lane rings mapped,
    accepted lane connections). gRPC's own fds come and go, so they are not counted."""
    pid = daemon.process.pid
    memfds = sum("memfd:hicached-lane" in link for link in fd_links(pid))
    rings = Path(f"/proc/{pid}/maps").read_text().count("memfd:hicached-lane")
    # /proc/net/unix names a socket by the address it was bound at: the daemon binds each
    # socket at a private name (``.hc-<pid>-l``) and links it to the public path.
    path = str(Path(path_of(daemon)).parent / f".hc-{pid}-l")
    conns = sum(line.endswith(" " + path) for line in Path("/proc/net/unix").read_text().splitlines()) - 1
    return memfds, rings, conns


def settled(daemon: Daemon) -> tuple[int, int, int]:
    """Wait until only the worker fixture's lane is held (earlier tests' lanes end asynchronously)."""
    return poll(lambda: daemon_resources(daemon), lambda r: r == (1, 1, 1), 10, "earlier lanes torn down")


def path_of(daemon: Daemon) -> str:
    path = lane_path(daemon.target)
    assert path is not None
    return path


def refused(call: object) -> HiCacheError:
    with pytest.raises(HiCacheError) as err:
        call()  # type: ignore[operator]
    return err.value


def test_a_wrong_secret_or_unknown_session_is_refused(worker: Worker, daemon: Daemon) -> None:
    sid = worker.session.session_id
    err = refused(lambda: FastLane.connect(path_of(daemon), sid, "0" * 32))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "wrong session secret" in err.message
    err = refused(lambda: FastLane.connect(path_of(daemon), sid, ""))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
    err = refused(lambda: FastLane.connect(path_of(daemon), "f" * 32, "0" * 32))
    assert err.code == grpc.StatusCode.NOT_FOUND


def test_a_malformed_negotiation_line_is_refused(daemon: Daemon) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path_of(daemon))
        s.sendall(b"GET / HTTP/1.1\n")
        reply = s.recv(512)
    assert reply.startswith(b"error INVALID_ARGUMENT expected 'hicached-lane-v1")


def test_lanes_per_session_are_bounded(worker: Worker) -> None:
    extra = [FastLane.open(worker.session), FastLane.open(worker.session)]  # the fixture's lane + 2 = limit 3
    try:
        err = refused(lambda: FastLane.open(worker.session))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "fast_lane_max_per_session" in err.message
    finally:
        for lane in extra:
            lane.close()
    FastLane.open(worker.session).close()  # closing gave the slots back


def test_another_uid_cannot_open_a_lane_even_with_the_secret(
    worker: Worker, daemon: Daemon, admin: HiCacheClient
) -> None:
    """SO_PEERCRED: the session is bound to our uid; the secret alone is not enough."""
    other_user()
    before = state(admin)
    code = (
        "import sys\n"
        "from hicached_client import HiCacheError\n"
        "from hicached_client.fastlane import FastLane\n"
        "try:\n"
        "    FastLane.connect(sys.argv[1], sys.argv[2], sys.argv[3])\n"
        "    print('OPENED')\n"
        "except HiCacheError as e:\n"
        "    print(e.code.name, e.message)\n"
    )
    proc = run_as_other(code, path_of(daemon), worker.session.session_id, worker.session.info.session_secret)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("PERMISSION_DENIED") and "bound to another uid" in proc.stdout
    assert state(admin) == before


def test_closing_lanes_frees_every_daemon_resource(worker: Worker, daemon: Daemon) -> None:
    baseline = settled(daemon)
    lanes = [FastLane.open(worker.session) for _ in range(2)]
    for lane in lanes:  # one round trip each: the daemon is past the negotiation (memfd closed)
        assert lane.write([Transfer("kv", [1])], allocate=True).ok
    memfds, rings, conns = daemon_resources(daemon)
    # Per lane: the ring mapping (and its own duplicate of the memfd) and the connection.
    assert (memfds - baseline[0], rings - baseline[1], conns - baseline[2]) == (2, 2, 2)
    for lane in lanes:
        lane.close()
        lane.close()  # idempotent
    # close() returns once the daemon has released its side: no waiting needed here.
    assert daemon_resources(daemon) == baseline


def test_detach_closes_the_lane(worker: Worker, daemon: Daemon) -> None:
    baseline = settled(daemon)
    lane = FastLane.open(worker.session)
    worker.session.detach()
    err = refused(lambda: lane.write([Transfer("kv", [1])], allocate=True))
    assert err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND), err
    poll(lambda: daemon_resources(daemon), lambda r: r[1] <= baseline[1] - 1, 10, "lane teardown at detach")


def test_a_broken_ring_closes_that_lane_only(worker: Worker) -> None:
    lane = FastLane.open(worker.session)
    lane._counters[w.SQ_TAIL // 8] = 1000
    os.eventfd_write(lane._submit, 1)
    poll(lambda: lane._poller.poll(0), bool, 10, "the daemon closing the broken lane")
    err = refused(lambda: lane.raw_completion(0, timeout_s=10))
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert worker.lane.write([Transfer("kv", [2])], allocate=True).ok, "the session's other lane still works"


DYING = """
import os, sys
from hicached_client import HiCacheClient, Transfer, WorkerIdentity
from hicached_client.fastlane import FastLane
from tests.support.kv import WorkerPools
pools = WorkerPools.create(sys.argv[2])
client = HiCacheClient(sys.argv[1])
session = client.attach(WorkerIdentity("dying-" + sys.argv[2], 1, "m-fastlane"), pools.specs())
lane = FastLane.open(session)
w = lane.write([Transfer("kv", list(range(512)))], allocate=True)
lane.start_load([Transfer("kv", list(range(512, 1024)), w.transfers[0].host_pages)])
print(session.session_id, flush=True)
os._exit(0)  # dies with the load in flight: no close, no detach
"""


def test_the_daemon_survives_a_client_dying_mid_operation(
    daemon: Daemon, admin: HiCacheClient, worker: Worker
) -> None:
    baseline = settled(daemon)
    tag = unique_tag("dying")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", DYING, daemon.target, tag], cwd=ROOT, capture_output=True, text=True, timeout=120,
            check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        sid = proc.stdout.strip()
        # Its lease runs out (no heartbeats): the session, its mappings and its lane go.
        poll(
            lambda: admin.get_stats().session(sid),
            lambda s: s is None,
            15,
            "the dead client's session expired",
        )
        poll(lambda: daemon_resources(daemon), lambda r: r == baseline, 15, "the dead client's lane freed")
    finally:
        for pool in ("kv", "draft"):
            Path(f"/dev/shm/hct-{tag}-{pool}").unlink(missing_ok=True)
    assert daemon.process.poll() is None
    ok = worker.lane.write([Transfer("kv", [3])], allocate=True)
    assert ok.ok and worker.lane.release_transfers(list(ok.transfers)) == 1


def test_without_the_lane_the_client_is_told_to_use_grpc() -> None:
    d = start_daemon("--set", "server.fast_lane=false")
    try:
        assert not Path(path_of(d)).exists()
        err = refused(lambda: FastLane.connect(path_of(d), "x" * 32, "y" * 32))
        assert err.code == grpc.StatusCode.UNAVAILABLE and "use gRPC" in err.message
    finally:
        d.stop()


def test_a_daemon_stopping_with_open_lanes_exits_cleanly_and_tells_the_client() -> None:
    d = start_daemon()
    pools = WorkerPools.create(unique_tag("stop"))
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            session = client.attach(WorkerIdentity("stopper", 1, "m-stop"), pools.specs(), heartbeat=False)
            lanes = [FastLane.open(session) for _ in range(2)]
            assert lanes[0].write([Transfer("kv", [1])], allocate=True).ok
            d.process.send_signal(signal.SIGTERM)
            assert d.process.wait(timeout=30) == 0, d.log
            err = refused(lambda: lanes[1].write([Transfer("kv", [2])], allocate=True))
            assert err.code == grpc.StatusCode.UNAVAILABLE
            for lane in lanes:
                lane.close()
            assert not Path(path_of(d)).exists(), "the daemon removes its lane socket at stop"
    finally:
        d.stop()
        for p in (pools.kv, pools.draft):
            p.close()
            p.unlink()


def test_a_negotiation_failing_after_admission_gives_its_slot_back(worker: Worker, daemon: Daemon) -> None:
    """A client that stops reading before the daemon sends the ring (EPIPE on the daemon's side)
    must not keep its lane slot: before the fix, each such attempt leaked one of the session's
    ``fast_lane_max_per_session`` (3 here) and the opens below were refused."""
    baseline = settled(daemon)
    line = b" ".join(
        [w.NEGOTIATE_MAGIC, worker.session.session_id.encode(), worker.session.info.session_secret.encode()]
    )
    for _ in range(4):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path_of(daemon))
            s.shutdown(socket.SHUT_RD)  # the daemon's send of the ring fails
            s.sendall(line + b"\n")
            poll(lambda: daemon_resources(daemon), lambda r: r == baseline, 10, "the refused lane torn down")
    extra = [FastLane.open(worker.session), FastLane.open(worker.session)]
    for lane in extra:
        lane.close()


def test_lanes_per_uid_are_bounded_across_sessions(worker: Worker, daemon: Daemon) -> None:
    pools = WorkerPools.create(unique_tag("uid"))
    opened: list[FastLane] = []
    try:
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            other = client.attach(WorkerIdentity(unique_tag("uid"), 1, "m-fastlane"), pools.specs())
            try:
                # The fixture's lane + 2 on the worker's session + 2 on another = the uid's limit of 5.
                opened += [FastLane.open(worker.session) for _ in range(2)]
                opened += [FastLane.open(other) for _ in range(2)]
                err = refused(lambda: FastLane.open(other))
                assert (
                    err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "fast_lane_max_per_uid" in err.message
                )
                opened.pop().close()
                opened.append(FastLane.open(other))  # a closed lane gave its slot back
            finally:
                for lane in opened:
                    lane.close()
                other.close()
    finally:
        for p in (pools.kv, pools.draft):
            p.close()
            p.unlink()


def test_a_load_given_up_on_leaves_its_layer_waits_a_clean_error(daemon: Daemon) -> None:
    """Fails before: once a load's result timed out (the lane closed: the daemon must not run
    it later), waiting for one of its layers raised AttributeError (the ring's counters gone)
    or OSError (a closed doorbell) instead of the lane's UNAVAILABLE."""
    pools = WorkerPools.create(unique_tag("flw"))
    try:
        pools.fill_random(9)
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            session = client.attach(WorkerIdentity(f"w-{unique_tag('wl')}", 1, "m-fastlane"), pools.specs())
            lane = FastLane.open(session)
            written = lane.write([Transfer("kv", [3, 4])], allocate=True)
            stop_process(daemon.process.pid)
            try:
                pending = lane.start_load([Transfer("kv", [10, 11], written.transfers[0].host_pages)])
                with pytest.raises(HiCacheError) as timed_out:
                    pending.result(timeout_s=0.3)
                assert timed_out.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and lane.closed
                for spin in (True, False):
                    with pytest.raises(HiCacheError) as err:
                        pending.wait_layer(0, timeout_s=1.0, spin=spin)
                    assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
                with pytest.raises(HiCacheError):
                    pending.layer_landed(0)
            finally:
                os.kill(daemon.process.pid, signal.SIGCONT)
            session.close()
    finally:
        pools.close()


HOLD_CONNECTIONS = """
import socket, sys
held = []
for i, path in enumerate(sys.argv[1:] * 600):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()
"""


def test_a_lane_past_descriptor_1023_on_both_sides_serves_and_gives_up_cleanly() -> None:
    """Fails before: the daemon's check for a closed lane, and the client's close, used
    select(), which refuses a descriptor past 1,023: a daemon holding that many connections
    lost every lane on its first request (ValueError, back to gRPC), and a client holding
    that many descriptors raised ValueError from a timed-out op instead of DEADLINE_EXCEEDED."""
    import resource

    d = start_daemon()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CONNECTIONS, str(d.socket), str(d.socket.parent / "admin.sock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    pools = WorkerPools.create(unique_tag("fdh"))
    try:
        assert holder.stdout is not None and int(holder.stdout.readline()) == 1200
        poll(
            lambda: len(fd_links(d.process.pid)),
            lambda n: n > 1100,
            30,
            "the daemon holding 1,200 connections",
        )
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
        filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # this side's next fds past 1,023
        with HiCacheClient(d.target, timeout_s=30.0, fast_lane=True) as client:
            session = client.attach(WorkerIdentity(f"w-{unique_tag('fd')}", 1, "m-fastlane"), pools.specs())
            keys = [unique_tag("k"), unique_tag("k")]
            assert session.lookup(keys).l2_hit_pages == 0
            lane = session._slot._lane
            assert lane is not None and lane._conn.fileno() > 1023
            assert session.lookup(keys).l2_hit_pages == 0
            assert session._slot._lane is lane and lane._tail == 2, "both lookups went over the lane"
            stop_process(d.process.pid)
            try:
                with pytest.raises(HiCacheError) as err:
                    session.put_pages(
                        keys, [Transfer("kv", [1, 2]), Transfer("draft", [1, 2])], timeout_s=0.3
                    )
                assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
            finally:
                os.kill(d.process.pid, signal.SIGCONT)
            session.close()
        assert "fast lane failed" not in d.log
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        holder.kill()
        holder.wait(timeout=30)
        pools.close()
        d.stop()
