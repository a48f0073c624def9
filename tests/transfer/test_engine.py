"""The copy engine: priorities, fairness, backpressure, cancellation, per-layer progress, shutdown."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from hicached.errors import Cancelled, InvalidArgument, OutOfRange, ResourceExhausted, Unavailable
from hicached.transfer import CopyEngine, CopyPlan, Direction, LayerStep, PageCopy, Priority

PAGES = 4
ROW = 64  # int64 words per page (512 B)
WAIT = 10.0


def make_plan(
    layers: tuple[int, ...] = (0, 1), seed: int = 0
) -> tuple[CopyPlan, list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 1 << 62, (PAGES, ROW), dtype=torch.int64, generator=gen) for _ in layers]
    dsts = [torch.zeros(PAGES, ROW, dtype=torch.int64) for _ in layers]
    idx = np.arange(PAGES, dtype=np.int64)
    rev = idx[::-1].copy()
    steps = tuple(
        LayerStep(layer=layer, copies=(PageCopy(src=s, dst=d, src_pages=idx, dst_pages=rev),))
        for layer, s, d in zip(layers, srcs, dsts, strict=True)
    )
    nbytes = len(layers) * PAGES * ROW * 8
    plan = CopyPlan(Direction.H2D, steps, nbytes, {"kv": PAGES}, {"kv": nbytes})
    return plan, srcs, dsts


def copied(src: torch.Tensor, dst: torch.Tensor) -> bool:
    return torch.equal(dst, src.flip(0))


@pytest.fixture
def engine() -> Iterator[CopyEngine]:
    eng = CopyEngine(workers=1, max_queued_bytes=1 << 20)
    yield eng
    eng.close()


class Gate:
    """Blocks the engine's only worker inside a job's ready() until opened."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def ready(self) -> None:
        self.entered.set()
        assert self.opened.wait(WAIT)

    def hold(self, engine: CopyEngine, owner: str = "gate") -> Future[object]:
        plan, _, _ = make_plan()
        fut = engine.submit(plan, priority=Priority.RESTORE, owner=owner, ready=self.ready)
        assert self.entered.wait(WAIT)
        return fut  # type: ignore[return-value]


def test_copies_all_layers_and_reports_bytes(engine: CopyEngine) -> None:
    plan, srcs, dsts = make_plan((0, 1, 2))
    result = engine.submit(plan, priority=Priority.DEMAND, owner="w").result(WAIT)
    assert result.nbytes == plan.nbytes == 3 * PAGES * ROW * 8
    assert result.seconds > 0
    assert all(copied(s, d) for s, d in zip(srcs, dsts, strict=True))


def test_ready_runs_before_the_first_copy_and_layers_report_in_order(engine: CopyEngine) -> None:
    plan, srcs, dsts = make_plan((0, 1, 2, -1))
    seen: list[tuple[str, int]] = []

    def ready() -> None:
        seen.append(("ready", int(sum(torch.count_nonzero(d) for d in dsts))))

    def on_layer(layer: int) -> None:
        i = [0, 1, 2, -1].index(layer)
        # This layer is complete when reported; later ones are untouched.
        assert copied(srcs[i], dsts[i])
        assert all(torch.count_nonzero(d) == 0 for d in dsts[i + 1 :])
        seen.append(("layer", layer))

    engine.submit(plan, priority=Priority.DEMAND, owner="w", ready=ready, on_layer=on_layer).result(WAIT)
    assert seen == [("ready", 0), ("layer", 0), ("layer", 1), ("layer", 2), ("layer", -1)]


def _tagged(engine: CopyEngine, order: list[str], tag: str, priority: Priority, owner: str) -> Future[object]:
    plan, _, _ = make_plan()
    return engine.submit(plan, priority=priority, owner=owner, ready=lambda: order.append(tag))  # type: ignore[return-value]


def test_lower_priority_value_runs_first(engine: CopyEngine) -> None:
    gate = Gate()
    held = gate.hold(engine)
    order: list[str] = []
    futs = [
        _tagged(engine, order, p.name, p, "w")
        for p in (Priority.WRITE_BACK, Priority.PREFETCH, Priority.DEMAND, Priority.RESTORE, Priority.DEMAND)
    ]
    assert engine.queue_depth() == {
        Priority.RESTORE: 1,
        Priority.DEMAND: 2,
        Priority.PREFETCH: 1,
        Priority.WRITE_BACK: 1,
    }
    gate.opened.set()
    for f in [held, *futs]:
        f.result(WAIT)
    assert order == ["RESTORE", "DEMAND", "DEMAND", "PREFETCH", "WRITE_BACK"]


def test_owners_of_one_priority_take_turns(engine: CopyEngine) -> None:
    gate = Gate()
    held = gate.hold(engine)
    order: list[str] = []
    futs = [_tagged(engine, order, f"a{i}", Priority.PREFETCH, "a") for i in range(3)]
    futs += [_tagged(engine, order, f"b{i}", Priority.PREFETCH, "b") for i in range(3)]
    futs += [_tagged(engine, order, "c0", Priority.PREFETCH, "c")]
    gate.opened.set()
    for f in [held, *futs]:
        f.result(WAIT)
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "b2"]


def test_full_queue_refuses_with_a_retry_hint_and_changes_nothing() -> None:
    plan, _, _ = make_plan()
    with CopyEngine(workers=1, max_queued_bytes=2 * plan.nbytes) as engine:
        gate = Gate()
        held = gate.hold(engine)  # running, so not counted as queued
        first = engine.submit(plan, priority=Priority.PREFETCH, owner="w")
        second = engine.submit(plan, priority=Priority.PREFETCH, owner="w")
        with pytest.raises(ResourceExhausted, match=f"holds {2 * plan.nbytes} bytes") as info:
            engine.submit(plan, priority=Priority.RESTORE, owner="x")
        assert info.value.retry_after_ms is not None and info.value.retry_after_ms >= 1
        assert engine.queued_bytes == 2 * plan.nbytes
        assert engine.queue_depth()[Priority.RESTORE] == 0
        gate.opened.set()
        for f in (held, first, second):
            f.result(WAIT)
        assert engine.queued_bytes == 0
        engine.submit(plan, priority=Priority.RESTORE, owner="x").result(WAIT)


def test_plan_larger_than_the_budget_runs_when_the_queue_is_empty() -> None:
    plan, srcs, dsts = make_plan((0, 1, 2, 3))
    with CopyEngine(workers=1, max_queued_bytes=plan.nbytes // 2) as engine:
        engine.submit(plan, priority=Priority.DEMAND, owner="w").result(WAIT)
    assert all(copied(s, d) for s, d in zip(srcs, dsts, strict=True))


def test_cancel_owner_cancels_queued_and_stops_running_work(engine: CopyEngine) -> None:
    gate = Gate()
    running = gate.hold(engine, owner="dead")
    plan_a, _, dsts_a = make_plan(seed=1)
    plan_b, srcs_b, dsts_b = make_plan(seed=2)
    queued = [engine.submit(plan_a, priority=Priority.DEMAND, owner="dead") for _ in range(2)]
    other = engine.submit(plan_b, priority=Priority.DEMAND, owner="alive")
    assert engine.cancel_owner("dead") == 2
    for f in queued:
        with pytest.raises(Cancelled, match="'dead'"):
            f.result(WAIT)
    assert engine.queued_bytes == plan_b.nbytes
    gate.opened.set()
    with pytest.raises(Cancelled):
        running.result(WAIT)  # stopped before its first layer
    other.result(WAIT)
    assert all(copied(s, d) for s, d in zip(srcs_b, dsts_b, strict=True))
    assert all(torch.count_nonzero(d) == 0 for d in dsts_a)
    assert engine.cancel_owner("nobody") == 0


def test_cancel_event_stops_between_layers(engine: CopyEngine) -> None:
    plan, srcs, dsts = make_plan((0, 1, 2))
    cancel = threading.Event()
    fut = engine.submit(
        plan, priority=Priority.PREFETCH, owner="w", on_layer=lambda _: cancel.set(), cancel=cancel
    )
    with pytest.raises(Cancelled, match="by its caller"):
        fut.result(WAIT)
    assert copied(srcs[0], dsts[0])
    assert torch.count_nonzero(dsts[1]) == 0 and torch.count_nonzero(dsts[2]) == 0


def test_future_cancelled_while_queued_never_runs(engine: CopyEngine) -> None:
    gate = Gate()
    held = gate.hold(engine)
    ran: list[str] = []
    fut = _tagged(engine, ran, "x", Priority.DEMAND, "w")
    assert fut.cancel()
    gate.opened.set()
    held.result(WAIT)
    engine.submit(make_plan()[0], priority=Priority.DEMAND, owner="w").result(WAIT)
    assert ran == []


def test_a_failing_copy_fails_only_its_future(engine: CopyEngine) -> None:
    plan, _, _ = make_plan()
    bad_copy = PageCopy(
        src=torch.zeros(2, ROW, dtype=torch.int64),
        dst=torch.zeros(2, ROW, dtype=torch.int64),
        src_pages=np.array([0, 5]),
        dst_pages=np.array([1, 0]),
    )
    bad = CopyPlan(Direction.D2H, (LayerStep(0, (bad_copy,)),), 16, {}, {})
    with pytest.raises(OutOfRange, match=r"source page 5 is out of range \[0, 2\)"):
        engine.submit(bad, priority=Priority.DEMAND, owner="w").result(WAIT)
    engine.submit(plan, priority=Priority.DEMAND, owner="w").result(WAIT)


def test_close_with_work_queued_fails_it_and_leaves_no_thread() -> None:
    engine = CopyEngine(workers=2, max_queued_bytes=1 << 20)
    gates = [Gate(), Gate()]
    running = [g.hold(engine, owner=f"g{i}") for i, g in enumerate(gates)]
    plan, _, dsts = make_plan()
    queued = [engine.submit(plan, priority=Priority.WRITE_BACK, owner="w") for _ in range(3)]
    closer = threading.Thread(target=engine.close)
    closer.start()
    for f in queued:
        with pytest.raises(Unavailable, match="shut down"):
            f.result(WAIT)
    for g in gates:
        g.opened.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    for f in running:
        with pytest.raises(Unavailable):
            f.result(WAIT)
    assert all(torch.count_nonzero(d) == 0 for d in dsts)
    assert not [t for t in threading.enumerate() if t.name.startswith("hicached-copy-")]
    with pytest.raises(Unavailable):
        engine.submit(plan, priority=Priority.DEMAND, owner="w")
    engine.close()  # idempotent


def test_many_submitters_in_parallel_all_complete_exactly() -> None:
    with CopyEngine(workers=2, max_queued_bytes=1 << 24) as engine:
        results: list[bool] = []
        lock = threading.Lock()

        def submitter(i: int) -> None:
            for j in range(10):
                plan, srcs, dsts = make_plan((0, 1), seed=100 * i + j)
                engine.submit(plan, priority=Priority(j % 4), owner=f"w{i}").result(WAIT)
                with lock:
                    results.append(all(copied(s, d) for s, d in zip(srcs, dsts, strict=True)))

        threads = [threading.Thread(target=submitter, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert results == [True] * 40


BAD_ARGS: list[tuple[str, Callable[[], object], str]] = [
    ("workers", lambda: CopyEngine(workers=0), "workers must be a positive int, got 0"),
    ("budget", lambda: CopyEngine(max_queued_bytes=0), "max_queued_bytes must be a positive int, got 0"),
]


@pytest.mark.parametrize(("case", "make", "needle"), BAD_ARGS, ids=[c[0] for c in BAD_ARGS])
def test_bad_engine_configuration_is_rejected(case: str, make: Callable[[], object], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        make()


def test_bad_submit_arguments_are_rejected(engine: CopyEngine) -> None:
    plan, _, _ = make_plan()
    with pytest.raises(InvalidArgument, match="unknown copy priority 7"):
        engine.submit(plan, priority=7, owner="w")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="owner must be a non-empty string"):
        engine.submit(plan, priority=Priority.DEMAND, owner="")
    assert engine.queued_bytes == 0


def test_engine_keeps_no_reference_to_finished_plans(engine: CopyEngine) -> None:
    plan, srcs, dsts = make_plan()
    src_ref, dst_ref = weakref.ref(srcs[0]), weakref.ref(dsts[0])
    engine.submit(plan, priority=Priority.DEMAND, owner="w").result(WAIT)
    del plan, srcs, dsts
    deadline = time.monotonic() + WAIT
    while (src_ref() is not None or dst_ref() is not None) and time.monotonic() < deadline:
        gc.collect()  # poll: the worker drops the job just after resolving its future
    assert src_ref() is None and dst_ref() is None


def test_a_copy_cancelled_in_flight_leaves_no_cycle_that_holds_its_plan(engine: CopyEngine) -> None:
    """The cancelled copy's error keeps the engine's frame in its traceback; were that frame
    to hold the error too (through the job's future or its stop_error), the plan -- a
    session's device views, so its mapped memory -- would live on until the cyclic collector
    ran. The collector is off here: the plan must go when the error does."""
    plan, srcs, _ = make_plan((0, 1))
    src = weakref.ref(srcs[0])
    gc.disable()
    try:
        try:  # runs on this thread (a slot is free); the end of layer 0 cancels layer 1
            engine.run(plan, priority=Priority.DEMAND, owner="w", on_layer=lambda _: engine.cancel_owner("w"))
        except Cancelled:
            pass
        else:
            pytest.fail("the copy was not cancelled")
        del plan, srcs
        assert src() is None, "the cancelled copy's plan outlived its error"
    finally:
        gc.enable()


def test_a_queued_copy_that_failed_leaves_no_cycle_that_holds_its_plan(engine: CopyEngine) -> None:
    """As the cancelled copy above, for a queued copy that failed (a page out of range): its
    error's traceback holds the worker's frame and so the job, which held the future that
    holds the error. The collector is off: the plan must go when the error does."""
    src = torch.zeros(2, ROW, dtype=torch.int64)
    copy = PageCopy(src=src, dst=torch.zeros(2, ROW, dtype=torch.int64), src_pages=np.array([0, 5]),
                    dst_pages=np.array([1, 0]))  # fmt: skip
    freed = threading.Event()
    weakref.finalize(src, freed.set)  # on whichever thread drops the last reference
    gc.disable()
    try:
        future = engine.submit(
            CopyPlan(Direction.D2H, (LayerStep(0, (copy,)),), 16, {}, {}), priority=Priority.DEMAND, owner="w"
        )
        del copy, src
        assert isinstance(future.exception(WAIT), OutOfRange)
        del future
        # The worker drops the job just after resolving the future: wait for the plan's end.
        assert freed.wait(WAIT), "the failed copy's plan outlived its error"
    finally:
        gc.enable()


def test_fairness_is_by_bytes_not_by_job_count(engine: CopyEngine) -> None:
    gate = Gate()
    held = gate.hold(engine)
    order: list[str] = []
    big, _, _ = make_plan((0, 1, 2, 3))  # 4 units
    small, _, _ = make_plan((0,))  # 1 unit
    futs = [
        engine.submit(big, priority=Priority.WRITE_BACK, owner="a", ready=lambda i=i: order.append(f"A{i}"))
        for i in range(3)
    ]
    futs += [
        engine.submit(small, priority=Priority.WRITE_BACK, owner="b", ready=lambda i=i: order.append(f"b{i}"))
        for i in range(6)
    ]
    gate.opened.set()
    for f in [held, *futs]:
        f.result(WAIT)
    # Round-robin by jobs would give "a" three times the bandwidth: A0 b0 A1 b1 A2 b2 ...
    assert order == ["A0", "b0", "b1", "b2", "b3", "A1", "b4", "b5", "A2"]


def test_close_joins_the_helper_threads_of_large_copies() -> None:
    engine = CopyEngine(workers=2)
    src = torch.ones(1200, 2048, dtype=torch.int64)  # 16 KiB pages, 600 of them = 9.4 MiB
    dst = torch.zeros(1200, 2048, dtype=torch.int64)
    sp = np.arange(600, dtype=np.int64)
    dp = np.random.default_rng(0).permutation(1200)[:600].astype(np.int64)
    plan = CopyPlan(Direction.H2D, (LayerStep(0, (PageCopy(src, dst, sp, dp),)),), 600 * 2048 * 8, {}, {})
    engine.submit(plan, priority=Priority.DEMAND, owner="w").result(WAIT)
    assert int(dst.sum()) == 600 * 2048
    if torch.get_num_threads() > 1:
        assert [t for t in threading.enumerate() if t.name.startswith("hicached-copy-helper")]
    engine.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("hicached-copy")]


def test_run_copies_on_the_calling_thread_when_a_slot_is_free(engine: CopyEngine) -> None:
    """No hand-off to a worker thread for a caller that waits anyway (the fixed cost of a call).
    Fails on the engine before CopyEngine.run, whose copies always ran on hicached-copy-*."""
    plan, srcs, dsts = make_plan()
    threads: list[threading.Thread] = []
    layers: list[int] = []
    result = engine.run(
        plan,
        priority=Priority.DEMAND,
        owner="w",
        ready=lambda: threads.append(threading.current_thread()),
        on_layer=layers.append,
    )
    assert threads == [threading.current_thread()]
    assert layers == [0, 1]
    assert result.nbytes == plan.nbytes
    assert all(copied(s, d) for s, d in zip(srcs, dsts, strict=True))


def test_run_waits_for_a_slot_and_runs_on_a_worker_when_all_are_busy(engine: CopyEngine) -> None:
    """With the only slot held, run() queues like submit() (never a second copy at once)."""
    gate = Gate()
    held = gate.hold(engine)
    plan, srcs, dsts = make_plan(seed=1)
    names: list[str] = []
    box: list[object] = []

    def call() -> None:
        box.append(
            engine.run(
                plan,
                priority=Priority.DEMAND,
                owner="w",
                ready=lambda: names.append(threading.current_thread().name),
            )
        )

    caller = threading.Thread(target=call)
    caller.start()
    # Woken by submit()'s notify (the only worker is inside the gate, so this is the only waiter).
    with engine._cv:
        assert engine._cv.wait_for(lambda: engine.queue_depth()[Priority.DEMAND] == 1, WAIT)
    gate.opened.set()
    held.result(WAIT)
    caller.join(WAIT)
    assert names and names[0].startswith("hicached-copy-")
    assert all(copied(s, d) for s, d in zip(srcs, dsts, strict=True))


def test_a_copy_run_on_the_caller_is_cancelled_with_its_owner(engine: CopyEngine) -> None:
    """cancel_owner() stops a copy running on a caller's thread like one on a worker."""
    plan, _, dsts = make_plan()
    with pytest.raises(Cancelled):
        engine.run(plan, priority=Priority.DEMAND, owner="w", ready=lambda: engine.cancel_owner("w"))
    assert not any(bool(d.any()) for d in dsts)  # stopped before the first layer
    plan2, srcs2, dsts2 = make_plan(seed=2)
    engine.run(plan2, priority=Priority.DEMAND, owner="other")  # the slot was given back
    assert all(copied(s, d) for s, d in zip(srcs2, dsts2, strict=True))


def test_run_after_close_is_refused() -> None:
    eng = CopyEngine(workers=1)
    plan, _, _ = make_plan()
    eng.run(plan, priority=Priority.DEMAND, owner="w")  # leaves an idle caller context
    eng.close()
    with pytest.raises(Unavailable):
        eng.run(plan, priority=Priority.DEMAND, owner="w")
