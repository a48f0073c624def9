"""L3 faults as clients meet them: no wait on a prefetch's L3 read outlasts
``limits.max_wait_s``, holds the lease reaper, or outlives its session; a flush whose writes
fail says so, once. Real daemons over real sockets; a fake Redis that refuses writes, or stops
answering (the RESP commands named) until told to resume."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
from hicached_client import (
    HiCacheClient,
    HiCacheError,
    PageBytes,
    PrefetchTicket,
    Session,
    Transfer,
    WorkerIdentity,
)

from tests.robustness.loop_support import PAGE_BYTES, FakeRedis, attach_bytes, fake_l3_daemon
from tests.support.daemon import Daemon
from tests.support.kv import POOLS, WorkerPools, unique_tag
from tests.support.state import poll


@pytest.fixture
def present_l3() -> Iterator[tuple[Daemon, FakeRedis]]:
    """A daemon whose L3 holds every key it is asked about (until its reads hang)."""
    with fake_l3_daemon("--set", "limits.max_wait_s=1", present=True) as (d, fake):
        yield d, fake


@pytest.fixture
def worker_pools() -> Iterator[list[WorkerPools]]:
    """Three workers' device pools (shared-memory segments), unlinked at the end."""
    made: list[WorkerPools] = []
    try:
        for _ in range(3):
            made.append(WorkerPools.create(unique_tag("l3f")))
        yield made
    finally:
        for pools in made:
            pools.close()


def _keys(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


def _live(daemon: Daemon) -> set[str]:
    with HiCacheClient(daemon.admin_target, timeout_s=5.0) as admin:
        return {s.session_id for s in admin.get_stats().sessions}


def test_an_expired_sessions_prefetch_in_flight_holds_no_other_expiry(
    present_l3: tuple[Daemon, FakeRedis],
) -> None:
    """Fails before: the lease reaper's teardown of a session waited for its prefetch's L3
    read, and the reaper runs one pass at a time: with the read hung, no other session
    expired (a review's session of a 1.5 s lease was alive 20 s on)."""
    daemon, fake = present_l3
    with HiCacheClient(daemon.target, timeout_s=10.0) as client:
        fake.hang(only=frozenset({b"GETRANGE"}))  # L3 reads hang; its hit queries answer
        first = attach_bytes(client, "m-reap", lease_ms=1500)  # no heartbeats: both expire
        first.prefetch(_keys(4))
        fake.wait_unanswered(1, timeout_s=30)  # its first batch waits on L3
        second = attach_bytes(client, "m-reap", lease_ms=1500)
        ids = {first.session_id, second.session_id}
        poll(lambda: _live(daemon) & ids, lambda left: not left, 20.0, "both sessions expired")


def test_cancel_prefetch_and_detach_end_at_max_wait_while_a_read_hangs(
    present_l3: tuple[Daemon, FakeRedis],
) -> None:
    """Fails before: CancelPrefetch and a Detach waited for the prefetch's batch in flight,
    so until L3's socket timeout (60 s here), past every client's deadline, each holding a
    lane thread. Now a cancel waits at most limits.max_wait_s (1 s) and a Detach not at all;
    the batch frees its own pages when its read returns."""
    daemon, fake = present_l3
    with HiCacheClient(daemon.target, timeout_s=10.0) as client:
        fake.hang(only=frozenset({b"GETRANGE"}))
        session = attach_bytes(client, "m-cancel", lease_ms=60_000)
        ticket = session.prefetch(_keys(4))
        fake.wait_unanswered(1, timeout_s=30)
        start = time.monotonic()
        assert session.cancel_prefetch(ticket.prefetch_id) == 0  # nothing was published
        assert time.monotonic() - start < 5.0
        other = attach_bytes(client, "m-cancel", lease_ms=60_000)
        other.prefetch(_keys(4))
        fake.wait_unanswered(2, timeout_s=30)
        start = time.monotonic()
        other.detach()
        assert time.monotonic() - start < 5.0
        assert other.session_id not in _live(daemon)
        session.detach()


def test_a_prefetch_planned_across_its_sessions_detach_is_cancelled(
    present_l3: tuple[Daemon, FakeRedis],
) -> None:
    """Fails before: a Prefetch still asking L3 which keys it holds when its session detached
    started its task all the same and answered a ticket: the teardown had cancelled the
    session's prefetches already, so the task ran on, counted against no session's
    limits.max_prefetches_per_session. Now the call is CANCELLED and its task stopped."""
    daemon, fake = present_l3
    with HiCacheClient(daemon.target, timeout_s=10.0) as client:
        fake.hang(only=frozenset({b"EXISTS"}))  # the plan's hit query waits
        session = attach_bytes(client, "m-race", lease_ms=60_000)
        answers: list[PrefetchTicket | HiCacheError] = []

        def prefetch() -> None:
            try:
                answers.append(session.prefetch(_keys(4)))
            except HiCacheError as exc:
                answers.append(exc)

        planning = threading.Thread(target=prefetch)
        planning.start()
        fake.wait_unanswered(1, timeout_s=30)
        session.detach()  # a Prefetch is not waited for: its plan is still out
        fake.resume()
        planning.join(timeout=30)
        (answer,) = answers
        assert isinstance(answer, HiCacheError), answer
        assert answer.code == grpc.StatusCode.CANCELLED, answer
        assert "ended while its prefetch was planned" in answer.message


def test_a_drain_whose_l3_writes_fail_says_so_once() -> None:
    """Fails before: a Drain(wait_flush) whose pages L3 refused answered OK with 0 flushed
    (and under write_through never tried them again). Now the flush writes them again and
    answers UNAVAILABLE naming them, with a hint the client's channel follows: not retried
    (each retry would write them all again; it sent 4 attempts when retried)."""
    # The fake answers SET with an error: L3 refuses every write.
    with (
        fake_l3_daemon() as (d, fake),
        HiCacheClient(d.target, timeout_s=10.0) as client,
        HiCacheClient(d.admin_target, timeout_s=10.0) as admin,
    ):
        session = attach_bytes(client, "m-drain", lease_ms=60_000)
        page = bytes(PAGE_BYTES)
        assert session.put_bytes([PageBytes(k, "kv", page) for k in _keys(2)]).stored_pages == 2
        fake.wait_seen(b"SET", 2, timeout_s=30)  # write_through tried them (refused)
        with pytest.raises(HiCacheError) as err:
            admin.drain(wait_flush=True)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        assert "2 backup pages could not be written to L3" in err.value.message
        assert err.value.retry_after_ms is not None and err.value.retry_after_ms < 0
        # One flush wrote the two again, once (or, if it began while the policy's refused
        # write was still being counted, reported that one): never once per retry.
        assert fake.seen[b"SET"] <= 4, fake.seen
        assert admin.resume() is True
        session.detach()


def test_a_read_behind_a_hung_redis_is_answered_once_not_retried() -> None:
    """Fails before: the daemon's UNAVAILABLE for an unreachable Redis carried no hint, so the
    client's channel sent the call again and again (4 attempts, each waiting the backend's
    socket timeout: 24.6 s for a 2 s timeout in a review). Now it says not to retry."""
    with (
        fake_l3_daemon("--set", "l3.redis.socket_timeout_s=1", "--set", "l3.redis.retries=0") as (d, fake),
        HiCacheClient(d.target, timeout_s=30.0) as client,
    ):
        session = attach_bytes(client, "m-hung-read", lease_ms=60_000)
        fake.hang(only=frozenset({b"EXISTS"}))
        with pytest.raises(HiCacheError) as err:
            session.get_bytes(_keys(1), include_l3=True)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        assert "is unreachable" in err.value.message
        assert err.value.retry_after_ms is not None and err.value.retry_after_ms < 0
        assert fake.seen[b"EXISTS"] == 1, fake.seen  # one attempt reached L3
        session.detach()


def test_a_waited_backup_says_why_it_stored_less() -> None:
    """Fails before: a Backup(wait) that L3 refused answered ``stored_pages=0`` with no
    reason, and one whose wait ran out looked the same. Now ``shortfall`` names each reason
    with its count (write_through_selective: only the explicit backup writes)."""
    args = ("--set", "l3.write_policy=write_through_selective", "--set", "limits.max_wait_s=1")
    with fake_l3_daemon(*args) as (d, fake), HiCacheClient(d.target, timeout_s=10.0) as client:
        session = attach_bytes(client, "m-shortfall", lease_ms=60_000)
        page = bytes(PAGE_BYTES)
        refused = _keys(2)
        assert session.put_bytes([PageBytes(k, "kv", page) for k in refused]).stored_pages == 2
        result = session.backup(refused, wait=True)  # the fake answers SET with an error
        assert (result.queued_pages, result.stored_pages) == (2, 0), result
        assert result.shortfall.startswith("2 not confirmed in L3: L3 failed or refused their batch"), result

        fake.hang(only=frozenset({b"SET"}))
        hung = _keys(3)
        assert session.put_bytes([PageBytes(k, "kv", page) for k in hung]).stored_pages == 3
        result = session.backup(hung, wait=True)
        assert (result.queued_pages, result.stored_pages) == (3, 0), result
        expected = "3 still being written when the wait ended after 1.0 s (they go on)"
        assert result.shortfall == expected, result
        assert session.backup(hung, wait=False).shortfall == ""


def _ending_with_a_call_in_flight(
    fake: FakeRedis, client: HiCacheClient, pools: WorkerPools
) -> threading.Thread:
    """A session of model ``m-end`` that owns 4 host pages per pool and ends (Detach) while its
    GetPages waits on L3: its teardown is deferred until that call returns."""
    ended = client.attach(WorkerIdentity("ending", 1, "m-end", tenant="ta"), pools.specs(host_ratio=0.5))
    assert ended.write([Transfer(n, list(range(4))) for n in POOLS], allocate=True).ok
    call = _a_call_waiting_on_l3(fake, ended)
    assert ended.detach() == 0  # past limits.max_wait_s: its pages are freed when the call ends
    return call


def _a_call_waiting_on_l3(fake: FakeRedis, session: Session) -> threading.Thread:
    """A GetPages of ``session`` waiting on L3 (the fake's EXISTS hangs until resumed)."""
    fake.hang(only=frozenset({b"EXISTS"}))

    def get() -> None:
        with contextlib.suppress(HiCacheError):  # its daemon may stop first
            session.get_pages(
                _keys(2), [Transfer(n, [500, 501]) for n in POOLS], include_l3=True, timeout_s=60
            )

    call = threading.Thread(target=get)
    call.start()
    fake.wait_unanswered(1, timeout_s=30)
    return call


def test_a_group_is_not_rebuilt_under_an_ended_sessions_call(worker_pools: list[WorkerPools]) -> None:
    """Fails before: an ended session whose call was still in flight did not count, so the next
    attach with larger pools rebuilt its group under the same id, and the session's late
    teardown freed its page numbers into the new group: pages another session held went to
    a third (a review read one tenant's bytes in another's GetPages). Now the group is in use
    until that teardown has run."""
    ending, mine, third = worker_pools
    with (
        fake_l3_daemon("--set", "limits.max_wait_s=0.5") as (d, fake),
        HiCacheClient(d.target, timeout_s=30.0) as client,
    ):
        call = _ending_with_a_call_in_flight(fake, client, ending)
        larger = WorkerIdentity("larger", 1, "m-end", tenant="tb")
        with pytest.raises(HiCacheError) as err:
            client.attach(larger, mine.specs(host_ratio=1.0))
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
        fake.resume()
        call.join(timeout=30)
        # The teardown ran when the call returned: now the group is rebuilt larger.
        b = client.attach(larger, mine.specs(host_ratio=1.0))
        c = client.attach(WorkerIdentity("third", 1, "m-end", tenant="tc"), third.specs(host_ratio=1.0))
        held_b = b.write([Transfer(n, list(range(64))) for n in POOLS], allocate=True)
        held_c = c.write([Transfer(n, list(range(64))) for n in POOLS], allocate=True)
        for tb, tc in zip(held_b.transfers, held_c.transfers, strict=True):
            assert not set(tb.host_pages) & set(tc.host_pages), (tb, tc)
        [group] = b.stats().groups
        assert {p.name: p.total_pages - p.free_pages for p in group.pools} == {"kv": 128, "draft": 128}


def test_an_ended_sessions_call_in_flight_shows_as_a_hold_of_its_group(
    worker_pools: list[WorkerPools],
) -> None:
    """Before: while an ended session's call kept its group in use, GetStats and ``hicached
    status`` showed the group with 0 sessions and nothing else, so nothing said why a larger
    attach of it was refused. Now the group's ``holds`` count it, until the call returns."""
    ending, _, _ = worker_pools
    with (
        fake_l3_daemon("--set", "limits.max_wait_s=0.5") as (d, fake),
        HiCacheClient(d.target, timeout_s=30.0) as client,
        HiCacheClient(d.admin_target, timeout_s=30.0) as admin,
    ):
        call = _ending_with_a_call_in_flight(fake, client, ending)
        [group] = admin.get_stats().groups
        assert (group.sessions, group.holds) == (0, 1), group
        # A worker of another tenant in the same group sees its own sessions only, and no hold.
        viewer = client.attach(
            WorkerIdentity("viewer", 1, "m-end", tenant="tv"), ending.specs(host_ratio=0.5)
        )
        [seen] = viewer.stats().groups
        assert (seen.sessions, seen.holds) == (1, 0), seen
        viewer.detach()
        shown = subprocess.run(
            [sys.executable, "-m", "hicached", "status", "--socket", d.admin_target.removeprefix("unix://")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert "sessions 0 (+1 attaching or ending)" in shown.stdout, shown.stdout
        fake.resume()
        call.join(timeout=30)
        poll(lambda: admin.get_stats().groups[0].holds, lambda n: n == 0, 30.0, "the teardown after the call")


def test_a_group_is_not_retired_under_an_ended_sessions_call(worker_pools: list[WorkerPools]) -> None:
    """Fails before: the same ended session's group was retired to make room for another
    model's, and its late teardown failed on the missing group (an ERROR with two tracebacks,
    the session's mappings never closed). Now the other model waits for room."""
    ending, other_pools, _ = worker_pools
    with (
        fake_l3_daemon("--set", "limits.max_wait_s=0.5", "--set", "host.max_groups=1") as (d, fake),
        HiCacheClient(d.target, timeout_s=30.0) as client,
    ):
        call = _ending_with_a_call_in_flight(fake, client, ending)
        other = WorkerIdentity("other", 1, "m-other")
        with pytest.raises(HiCacheError) as err:
            client.attach(other, other_pools.specs())
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        fake.resume()
        call.join(timeout=30)
        client.attach(other, other_pools.specs()).detach()
        log = d.log
    assert "Traceback" not in log, log[-3000:]


def test_two_attaches_replacing_one_slot_leave_one_session(worker_pools: list[WorkerPools]) -> None:
    """Fails before: both attaches of generation 2 passed the generation check while the first
    waited (up to limits.max_wait_s) for generation 1's call in flight, and both were added:
    two live sessions of one worker slot, the first no longer in the slot (it lived on until
    its lease ran out). Now the later of the two is FAILED_PRECONDITION."""
    first, second, _ = worker_pools
    with (
        fake_l3_daemon("--set", "limits.max_wait_s=0.5") as (d, fake),
        HiCacheClient(d.target, timeout_s=30.0) as client,
    ):
        call = _a_call_waiting_on_l3(fake, client.attach(WorkerIdentity("slot", 1, "m-slot"), first.specs()))
        barrier = threading.Barrier(2)
        codes: list[grpc.StatusCode | None] = []

        def attach(pools: WorkerPools) -> None:
            barrier.wait(timeout=30)
            try:
                client.attach(WorkerIdentity("slot", 2, "m-slot"), pools.specs())
                codes.append(None)
            except HiCacheError as exc:
                codes.append(exc.code)

        both = [threading.Thread(target=attach, args=(p,)) for p in (first, second)]
        for t in both:
            t.start()
        for t in both:
            t.join(timeout=30)
        assert sorted(codes, key=str) == sorted([None, grpc.StatusCode.FAILED_PRECONDITION], key=str), codes
        with HiCacheClient(d.admin_target, timeout_s=10.0) as admin:
            live = [s for s in admin.get_stats().sessions if s.identity.instance_id == "slot"]
        assert [s.identity.generation for s in live] == [2], live
        fake.resume()
        call.join(timeout=30)


@pytest.mark.parametrize("fast_lane", [False, True], ids=["grpc", "lane"])
def test_a_get_whose_caller_stopped_waiting_during_the_l3_read_copies_nothing(
    fast_lane: bool, worker_pools: list[WorkerPools]
) -> None:
    """Fails before (a review's repro, over gRPC and over the fast lane alike): a GetPages with
    include_l3 waited on a hung L3 past its caller's deadline; the caller, told it failed,
    reused its device pages; once L3 answered, the daemon copied the cached prefix into them.
    Now the daemon asks whether the caller still waits once the L3 read is done, before any
    copy: it does not, so nothing is written."""
    pools = worker_pools[0]
    pools.fill_random(14)
    with (
        fake_l3_daemon() as (d, fake),
        HiCacheClient(d.target, timeout_s=30.0, fast_lane=fast_lane) as client,
    ):
        session = client.attach(WorkerIdentity(f"late-{unique_tag('g')}", 1, "m-late"), pools.specs())
        keys = _keys(4)
        both = [Transfer(n, [1, 2]) for n in POOLS]
        assert session.put_pages(keys[:2], both).stored_pages == 2  # the first two are in L2
        assert session.lookup(keys).l2_hit_pages == 2  # (opens the lane when asked for)
        fake.hang(only=frozenset({b"EXISTS"}))
        dst = [Transfer(n, [40, 41, 42, 43]) for n in POOLS]
        with pytest.raises(HiCacheError) as err:
            session.get_pages(keys, dst, include_l3=True, op_id="late-get", timeout_s=1.0)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        fake.wait_unanswered(1, timeout_s=30)
        pools.clobber()  # the caller reuses its pages (every page now 0xFF)
        fake.resume()
        # The same op id again: answered with the first call's outcome once that call ended.
        with pytest.raises(HiCacheError) as again:
            session.get_pages(keys, dst, include_l3=True, op_id="late-get", timeout_s=30.0)
        assert again.value.code == grpc.StatusCode.CANCELLED, again.value
        for name in POOLS:
            assert pools.untouched(name, excluding=[]), f"pool {name} was written late"
        session.close()


def test_replacing_a_session_whose_call_hangs_holds_no_bookkeeping_thread(
    worker_pools: list[WorkerPools],
) -> None:
    """Fails before (a review of stop 46): an attach replacing a session waited on its
    bookkeeping thread, up to limits.max_wait_s, for the old session's call in flight; with
    L3 hung, eight such attaches (one thread here) held every bookkeeping thread, and other
    clients' GetStats and Attach waited with them. Now the old session ends at once and its
    teardown runs when its call returns, as after a lease expiry."""
    pools = worker_pools[0]
    with (
        fake_l3_daemon("--set", "server.bookkeeping_threads=1", "--set", "limits.max_wait_s=60") as (d, fake),
        HiCacheClient(d.target, timeout_s=30.0) as client,
        HiCacheClient(d.admin_target, timeout_s=10.0) as admin,
    ):
        bystander = attach_bytes(client, "m-bystander")
        old = client.attach(WorkerIdentity("slot-r", 1, "m-replace"), pools.specs(), heartbeat=False)
        group = old.info.group
        call = _a_call_waiting_on_l3(fake, old)
        new = client.attach(WorkerIdentity("slot-r", 2, "m-replace"), pools.specs(), timeout_s=10.0)
        assert new.info.replaced_session_id == old.session_id
        assert bystander.stats(timeout_s=5.0).host_used_bytes > 0
        attach_bytes(client, "m-newcomer").detach()
        # The old session's pages go back when its call returns (its teardown, deferred).
        fake.resume()
        call.join(timeout=30)
        new.detach()

        def free_pages() -> list[tuple[int, int]]:
            [g] = [g for g in admin.get_stats().groups if g.group == group]
            return [(p.free_pages, p.total_pages) for p in g.pools]

        poll(free_pages, lambda got: all(f == t for f, t in got), 10.0, "the group's pages back")
