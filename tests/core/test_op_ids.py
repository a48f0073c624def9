"""One op-id mechanism (Session.run): keyed by (RPC, op_id), checked by a digest of the call,
remembering only answers no retry could change, bounded in bytes. In-process core, no gRPC."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import numpy as np
import pytest

from hicached.core.opcache import OpCache, op_digest
from hicached.errors import InvalidArgument, OutOfRange, ResourceExhausted
from hicached.l2.group import PoolTransfer
from tests.core.conftest import Core, pages


def test_a_retry_with_the_same_op_id_gets_the_first_answer_and_allocates_once(
    make_core: Callable[..., Core],
) -> None:
    c = make_core()
    sid = c.attach()
    free_before = c.pools(sid)["kv"][0]
    first = c.core.alloc(sid, "op-1", "kv", 3)
    again = c.core.alloc(sid, "op-1", "kv", 3)
    assert first is not None and again is not None
    assert first.tolist() == again.tolist()
    assert c.pools(sid)["kv"][0] == free_before - 3 and c.owned(sid) == 3


def test_the_same_op_id_on_another_rpc_is_a_separate_operation(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: one namespace for every RPC, so Free with Alloc's op_id returned
    Alloc's stored page array (an INTERNAL TypeError once the servicer built its answer)."""
    c = make_core()
    sid = c.attach()
    got = c.core.alloc(sid, "shared", "kv", 2)
    assert got is not None
    freed = c.core.free(sid, "shared", "kv", got)
    assert freed == 2 and isinstance(freed, int)
    assert c.owned(sid) == 0
    assert c.core.free(sid, "shared", "kv", got) == 2  # Free's own replay, not a double free


def test_the_same_op_id_with_another_body_is_invalid_argument_quoting_a_short_prefix(
    make_core: Callable[..., Core],
) -> None:
    """Fails before the fix: the second body silently got the first body's answer."""
    c = make_core()
    sid = c.attach()
    op = "x" * 40 + "TAIL-NOT-QUOTED" + "y" * 10_000
    assert c.core.alloc(sid, op, "kv", 1) is not None
    with pytest.raises(InvalidArgument) as err:
        c.core.alloc(sid, op, "kv", 2)
    message = str(err.value)
    assert "x" * 32 in message and "TAIL-NOT-QUOTED" not in message and len(message) < 300
    assert c.owned(sid) == 1  # nothing allocated for the refused body


def test_a_transient_no_room_answer_is_not_remembered(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: the first "no room" answer was replayed to every retry."""
    c = make_core()
    sid = c.attach()
    total = c.pools(sid)["kv"][1]
    held = c.core.alloc(sid, "", "kv", total)
    assert held is not None
    assert c.core.alloc(sid, "retry-me", "kv", 2) is None  # full, nothing to reclaim
    c.core.free(sid, "", "kv", held[:2])
    again = c.core.alloc(sid, "retry-me", "kv", 2)
    assert again is not None and sorted(again.tolist()) == sorted(held[:2].tolist())


def test_a_put_bytes_retried_after_resource_exhausted_succeeds_once_room_exists(
    make_core: Callable[..., Core],
) -> None:
    """Fails before the fix: the RESOURCE_EXHAUSTED outcome was cached under the op_id."""
    c = make_core()
    sid = c.attach(derived=False)
    total = c.pools(sid)["kv"][1]
    _, state = c.core.session_group(sid)
    sizes = {p: state.pool(p).page_bytes for p in ("kv", "swa")}
    held = c.core.alloc(sid, "", "kv", total)
    assert held is not None
    body = [(f"k{i}", p, bytes([i]) * sizes[p]) for i in range(2) for p in ("kv", "swa")]
    with pytest.raises(ResourceExhausted):
        c.keyed.put_bytes(sid, "put-1", body)
    c.core.free(sid, "", "kv", held)
    assert c.keyed.put_bytes(sid, "put-1", body) == (2, 0)
    assert c.keyed.put_bytes(sid, "put-1", body) == (2, 0)  # replayed, not stored twice
    assert c.indexed(sid) == 2


def test_a_permanent_error_is_replayed_without_keeping_the_exception(make_core: Callable[..., Core]) -> None:
    c = make_core()
    sid = c.attach()
    with pytest.raises(OutOfRange):
        c.core.free(sid, "bad", "kv", [10**6])
    session, _ = c.core.session_group(sid)
    assert len(session.ops) == 1  # remembered (as class and message)
    with pytest.raises(OutOfRange, match="out of range"):
        c.core.free(sid, "bad", "kv", [10**6])


def test_remembered_errors_do_not_hold_their_traceback() -> None:
    """Fails before the fix: the op cache kept each exception, whose traceback kept every
    frame's locals (here 8 MB) alive for as long as the op_id was remembered."""
    cache = OpCache(max_entries=100, max_bytes=1 << 20)

    class Big:
        blob = np.zeros(1 << 20)

    ref: list[weakref.ref[Big]] = []

    def failing() -> None:
        big = Big()
        ref.append(weakref.ref(big))
        raise InvalidArgument("bad request")

    with pytest.raises(InvalidArgument):
        cache.run("Free", "op", (), failing)
    gc.collect()
    assert ref[0]() is None
    with pytest.raises(InvalidArgument, match="bad request"):
        cache.run("Free", "op", (), failing)
    assert len(ref) == 1  # replayed, not run again


def test_400_alloc_free_rounds_stay_within_the_byte_bound(make_core: Callable[..., Core]) -> None:
    """Fails before the fix: every answer was kept (the issue measured 211 MB for 400 rounds
    of 65,536-page answers); the bound is now in bytes (sessions.op_cache_bytes)."""
    bound = 64 << 10
    c = make_core(op_cache_bytes=bound)
    sid = c.attach()
    session, _ = c.core.session_group(sid)
    n = c.pools(sid)["kv"][1]
    peak = 0
    for i in range(400):
        got = c.core.alloc(sid, f"a{i}", "kv", n)
        assert got is not None
        assert c.core.free(sid, f"f{i}", "kv", got) == n
        peak = max(peak, session.ops.nbytes)
    assert 0 < peak <= bound
    assert len(session.ops) < 800  # old answers were evicted
    assert c.owned(sid) == 0


def test_digest_is_canonical_and_tells_bodies_apart() -> None:
    t = [PoolTransfer("kv", pages([1, 2]))]
    assert op_digest((t, True)) == op_digest(([PoolTransfer("kv", np.array([1, 2], dtype=np.int32))], True))
    assert op_digest((t, True)) != op_digest((t, False))
    assert op_digest(("ab", "c")) != op_digest(("a", "bc"))
    assert op_digest([b"\x00"]) != op_digest([b"\x00\x00"])


def test_digest_fast_path_and_general_path_encode_alike() -> None:
    """Exact types go through a dict of encoders, anything else through isinstance checks:
    both must give one encoding per value (a bool is never an int; a non-contiguous page
    array digests like its contiguous copy)."""

    class Name(str):
        pass

    strided = np.arange(8, dtype=np.int64)[::2]
    assert op_digest(Name("kv")) == op_digest("kv")
    assert op_digest(np.int64(5)) == op_digest(5)
    assert op_digest(True) != op_digest(1)
    assert op_digest(strided) == op_digest(np.array([0, 2, 4, 6]))
    assert op_digest(strided) != op_digest(np.array([0, 2, 4, 8]))
    assert op_digest(bytearray(b"ab")) == op_digest(b"ab")


def test_digest_of_a_list_of_strings_tells_every_split_apart() -> None:
    """A request's keys are digested in one piece (their lengths say where each ends): the same
    keys digest alike as a list, a tuple or str subclasses; any other split, order or kind differs."""

    class Name(str):
        pass

    keys = [f"{i:064x}@m" for i in range(128)]
    assert op_digest(keys) == op_digest(tuple(keys)) == op_digest([Name(k) for k in keys])
    different = [
        ["ab", "c"],
        ["a", "bc"],
        ["abc"],
        ["c", "ab"],
        ["", "x"],
        ["x", ""],
        ["x"],
        ["é", "\udc80"],  # non-ASCII, a lone surrogate
        ["e", "\udc80"],
        ["1", "2"],
        ["1", 2],  # strings are not numbers
        [1, 2],
        [["ab"], "c"],  # nested lists of strings too
        [["a"], "bc"],
    ]
    assert len({op_digest(body) for body in different}) == len(different)


def test_a_write_replay_returns_the_first_result(make_core: Callable[..., Core]) -> None:
    c = make_core()
    sid = c.attach()
    batch = [PoolTransfer("kv", pages([0, 1])), PoolTransfer("swa", pages([0, 1])), PoolTransfer("draft")]
    first = c.core.write(sid, "w1", batch, allocate=True)
    second = c.core.write(sid, "w1", batch, allocate=True)
    assert first.ok and second is first
    assert c.owned(sid) == 4


def test_a_concurrent_duplicate_runs_nothing_and_gets_the_first_answer() -> None:
    cache = OpCache(max_entries=10, max_bytes=1 << 20)
    started, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow() -> int:
        calls.append(1)
        started.set()
        assert release.wait(10)
        return 7

    results: list[int] = []
    first = threading.Thread(target=lambda: results.append(cache.run("Alloc", "op", (), slow)))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: results.append(cache.run("Alloc", "op", (), slow)))
    second.start()  # waits on the first call's outcome, or replays it if that already finished
    release.set()
    first.join(10)
    second.join(10)
    assert results == [7, 7] and calls == [1]
    with pytest.raises(InvalidArgument, match="different Alloc request"):
        cache.run("Alloc", "op", ("other",), slow)


def test_a_duplicate_waiting_on_a_failing_call_gets_its_error_and_runs_nothing() -> None:
    """A transient error is not remembered, but a duplicate already waiting shares it."""
    cache = OpCache(max_entries=10, max_bytes=1 << 20)
    started, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def failing() -> int:
        calls.append(1)
        started.set()
        assert release.wait(10)
        raise ResourceExhausted("no room", retry_after_ms=5)

    errors: list[BaseException] = []

    def call() -> None:
        try:
            cache.run("Alloc", "op", (), failing)
        except ResourceExhausted as exc:
            errors.append(exc)

    first = threading.Thread(target=call)
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=call)
    second.start()
    flight = cache._running[("Alloc", "op")]
    while flight.ended is None:  # the duplicate registers as a waiter (state, not time)
        assert second.is_alive()
        threading.Event().wait(0.001)
    release.set()
    first.join(10)
    second.join(10)
    assert calls == [1] and len(errors) == 2 and errors[0] is errors[1]
    assert not cache._running and len(cache) == 0  # transient: forgotten, so a retry runs again
