"""The I/O scheduler and prefetch progress, with jobs that record what ran when."""

from __future__ import annotations

import logging
import threading
import tracemalloc
from collections.abc import Callable, Sequence

import pytest

from hicached.errors import InvalidArgument, Unavailable
from hicached.index import PrefetchPolicy, PrefetchState, PrefetchStatus, PrefetchTask
from hicached.index.jobs import BackupJob, IoPriority, IoScheduler


class Recorder:
    """A job of ``steps`` steps that logs each step; the first step may wait on a gate."""

    def __init__(
        self, name: str, log: list[str], steps: int = 1, gate: threading.Event | None = None
    ) -> None:
        self.name, self.log, self.left, self.gate = name, log, steps, gate
        self.started = threading.Event()
        self.abandoned: BaseException | None = None
        self.done = threading.Event()

    def step(self) -> bool:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30)
            self.gate = None
        self.log.append(self.name)
        self.left -= 1
        if self.left == 0:
            self.done.set()
        return self.left > 0

    def abandon(self, reason: BaseException | None) -> None:
        self.abandoned = reason
        self.done.set()


def test_prefetch_jobs_run_before_backups_and_jobs_interleave() -> None:
    log: list[str] = []
    scheduler = IoScheduler(1, "test")
    try:
        gate = threading.Event()
        blocker = Recorder("blocker", log, gate=gate)
        scheduler.submit(blocker, IoPriority.BACKUP)
        assert blocker.started.wait(30)
        backup = Recorder("backup", log, steps=2)
        first = Recorder("p1", log, steps=2)
        second = Recorder("p2", log, steps=2)
        scheduler.submit(backup, IoPriority.BACKUP)
        scheduler.submit(first, IoPriority.PREFETCH)
        scheduler.submit(second, IoPriority.PREFETCH)
        gate.set()
        assert backup.done.wait(30)
        assert log == ["blocker", "p1", "p2", "p1", "p2", "backup", "backup"]
    finally:
        scheduler.close()


def test_close_abandons_queued_jobs_and_later_submissions() -> None:
    log: list[str] = []
    scheduler = IoScheduler(1, "test")
    gate = threading.Event()
    blocker = Recorder("blocker", log, gate=gate)
    scheduler.submit(blocker, IoPriority.BACKUP)
    assert blocker.started.wait(30)
    queued = Recorder("queued", log)
    scheduler.submit(queued, IoPriority.BACKUP)
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    assert queued.done.wait(30)
    assert queued.abandoned is not None
    gate.set()
    closer.join(30)
    assert log == ["blocker"]
    late = Recorder("late", log)
    scheduler.submit(late, IoPriority.PREFETCH)
    assert late.abandoned is not None
    with pytest.raises(InvalidArgument):
        IoScheduler(0, "bad")


def test_a_raising_step_abandons_its_job_and_the_thread_survives() -> None:
    scheduler = IoScheduler(1, "test")
    try:
        released: list[tuple[list[int], bool]] = []

        def store(batch: Sequence[int]) -> tuple[int, bool]:
            raise OSError("disk on fire")

        job: BackupJob[int] = BackupJob(
            [[1, 2], [3]], store=store, release=lambda e, ok: released.append((list(e), ok))
        )
        scheduler.submit(job, IoPriority.BACKUP)
        assert job.wait(30)
        assert job.failed and job.stored_pages == 0
        assert released == [([1, 2], False), ([3], False)]
        after = Recorder("after", [])
        scheduler.submit(after, IoPriority.BACKUP)
        assert after.done.wait(30)
    finally:
        scheduler.close()


def test_an_outage_is_one_warning_per_job_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """Fails before: every failed batch of an unreachable backend was an ERROR with its
    traceback (130 KB of log a second in a review, past log.max_rate, which spares ERRORs)."""
    scheduler = IoScheduler(1, "test")
    try:

        def store(batch: Sequence[int]) -> tuple[int, bool]:
            raise Unavailable("redis server at 127.0.0.1:1 is unreachable")

        job: BackupJob[int] = BackupJob([[1], [2]], store=store, release=lambda e, ok: None)
        with caplog.at_level(logging.WARNING, logger="hicached.index.jobs"):
            scheduler.submit(job, IoPriority.BACKUP)
            after = Recorder("after", [])  # the one thread runs it once the failure is logged
            scheduler.submit(after, IoPriority.BACKUP)
            assert after.done.wait(30)
        lines = [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records]
        assert lines == [
            (
                logging.WARNING,
                "content-index I/O job failed: redis server at 127.0.0.1:1 is unreachable",
                None,
            )
        ]
    finally:
        scheduler.close()


def fetcher(gates: list[threading.Event]) -> Callable[[Sequence[str], Callable[[], bool]], tuple[int, bool]]:
    def fetch(keys: Sequence[str], discard: Callable[[], bool]) -> tuple[int, bool]:
        assert gates.pop(0).wait(30)
        return (0, False) if discard() else (len(keys), True)

    return fetch


def test_progress_can_be_followed_batch_by_batch() -> None:
    gates = [threading.Event() for _ in range(3)]
    task = PrefetchTask(
        "t", ["a", "b", "c", "d", "e"], policy=PrefetchPolicy.BEST_EFFORT, timeout_s=1.0,
        batch_pages=2, fetch=fetcher(list(gates)),
    )  # fmt: skip
    scheduler = IoScheduler(1, "test")
    try:
        scheduler.submit(task, IoPriority.PREFETCH)
        assert task.next_status(0, timeout_s=0.01) == PrefetchStatus(PrefetchState.RUNNING, 0, 5)
        seen: list[PrefetchStatus] = []
        for gate in gates:
            gate.set()
            status = task.next_status(seen[-1].completed_pages if seen else 0, timeout_s=30)
            seen.append(status)
        assert [s.completed_pages for s in seen] == [2, 4, 5]
        assert seen[-1].state is PrefetchState.DONE
    finally:
        scheduler.close()


@pytest.mark.parametrize("end", ["done", "timed out", "cancelled", "failed"])
def test_a_finished_prefetch_lets_go_of_its_keys(end: str) -> None:
    """Before: a finished task kept its whole key list, and the index keeps the last 1,024
    finished tasks for their status: a session's Prefetch of 65,536 keys that timed out at
    once grew the daemon by ~10 MiB a call, for good."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        task = PrefetchTask(
            "t", [f"{i:08d}-" + "k" * 90 for i in range(4096)],
            policy=PrefetchPolicy.TIMEOUT, timeout_s=0.0 if end == "timed out" else 60.0,
            batch_pages=4096, fetch=lambda keys, discard: (len(keys), end != "failed"),
        )  # fmt: skip
        held = tracemalloc.get_traced_memory()[0] - base
        assert held > 400_000  # 4,096 keys of ~100 characters
        if end == "cancelled":
            task.cancel()
        else:
            task.step()
        assert task.finished
        assert tracemalloc.get_traced_memory()[0] - base < held // 10, end
        assert task.status().planned_pages == 4096  # what a status reports stays
    finally:
        tracemalloc.stop()
