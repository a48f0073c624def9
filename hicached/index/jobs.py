"""Background L3 I/O of the content index: a small priority scheduler and its jobs.

:class:`IoScheduler` runs :class:`IoJob` steps on a fixed set of threads.
One step moves one batch (128 pages by default); a job that has more
batches goes to the back of its queue, so jobs of one priority share the
threads fairly, and a job never runs on two threads at once (its batches
stay in order, which is what "stop at the first failed batch" needs).
Prefetches (a worker may be waiting) always go before backups.

:class:`PrefetchTask` and :class:`BackupJob` know nothing of pools or
backends: the index hands them the functions that move one batch.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from hicached.errors import InvalidArgument, Unavailable
from hicached.index.types import PrefetchPolicy, PrefetchState, PrefetchStatus

__all__ = ["BackupJob", "IoJob", "IoPriority", "IoScheduler", "PrefetchTask"]

logger = logging.getLogger(__name__)


class IoPriority(enum.IntEnum):
    PREFETCH = 0
    BACKUP = 1


class IoJob(Protocol):
    def step(self) -> bool:
        """Move one batch; True when the job has more batches."""

    def abandon(self, reason: BaseException | None) -> None:
        """The job will not be stepped again (scheduler closing, or a step raised
        ``reason``): release whatever it holds and wake its waiters."""


class IoScheduler:
    """Fixed worker threads draining two FIFO queues, prefetch first.

    Thread-safety: ``submit`` and ``close`` may be called from any thread.
    ``close`` abandons queued jobs, lets running steps finish and joins the
    threads; a job submitted after ``close`` is abandoned at once.
    """

    def __init__(self, workers: int, name: str) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidArgument(f"io_workers must be a positive int, got {workers!r}")
        self._cond = threading.Condition()
        self._queues: dict[IoPriority, collections.deque[IoJob]] = {
            p: collections.deque() for p in IoPriority
        }
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-io{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: IoJob, priority: IoPriority) -> None:
        with self._cond:
            if not self._closed:
                self._queues[priority].append(job)
                self._cond.notify()
                return
        job.abandon(Unavailable("the content index is closed"))

    def _next(self) -> tuple[IoJob, IoPriority] | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                for priority in IoPriority:
                    queue = self._queues[priority]
                    if queue:
                        return queue.popleft(), priority
                self._cond.wait()

    def _run(self) -> None:
        while (item := self._next()) is not None:
            job, priority = item
            try:
                more = job.step()
            except Unavailable as exc:
                # The backend's word for "unusable now" (an outage): expected, so one line per
                # job under the log's rate limit, not an ERROR and a traceback per batch.
                logger.warning("content-index I/O job failed: %s", exc)
                job.abandon(exc)
                continue
            except Exception as exc:  # a backend bug must not kill the I/O thread
                logger.exception("content-index I/O job failed")
                job.abandon(exc)
                continue
            if more:
                self.submit(job, priority)

    def stop(self) -> None:
        """Abandon queued jobs and take no more; a job running on a thread finishes
        its step (it may be waiting on L3). Idempotent."""
        with self._cond:
            self._closed = True
            pending = [job for q in self._queues.values() for job in q]
            for q in self._queues.values():
                q.clear()
            self._cond.notify_all()
        for job in pending:
            job.abandon(Unavailable("the content index is closed"))

    def close(self) -> None:
        """:meth:`stop`, then join the threads. Idempotent."""
        self.stop()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()


# fetch(keys, discard) -> (pages now published, batch fully succeeded). ``discard()``
# is asked after the bytes arrived: True means free them instead of publishing.
FetchBatch = Callable[[Sequence[str], Callable[[], bool]], tuple[int, bool]]


class PrefetchTask:
    """One L3 -> L2 prefetch: its planned keys, progress, and stop policy.

    Thread-safety: every method may be called from any thread. ``cancel``
    (waiting, without a deadline) returns only once no batch of this task is
    in flight, so the pages of an interrupted batch have been freed when it
    returns; without the wait, that batch frees them when its read returns.
    """

    def __init__(
        self,
        task_id: str,
        keys: Sequence[str],
        *,
        policy: PrefetchPolicy,
        timeout_s: float,
        batch_pages: int,
        fetch: FetchBatch,
    ) -> None:
        self.id = task_id
        self.policy = policy
        self.planned_pages = len(keys)
        self.timeout_s = timeout_s
        self._keys = list(keys)
        self._batch = batch_pages
        self._fetch = fetch
        self._cond = threading.Condition()
        self._state = PrefetchState.RUNNING if keys else PrefetchState.DONE
        self._completed = 0
        self._cursor = 0
        self._in_flight = False
        self._deadline = time.monotonic() + timeout_s

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._state is not PrefetchState.RUNNING

    def status(self) -> PrefetchStatus:
        with self._cond:
            return PrefetchStatus(self._state, self._completed, self.planned_pages)

    def next_status(self, completed_pages: int, timeout_s: float | None = None) -> PrefetchStatus:
        """Block until more than ``completed_pages`` pages completed, the prefetch
        finished, or ``timeout_s`` passed; then report. For progress streams:
        call again with the last ``completed_pages`` seen until the state is
        no longer ``running``.
        """
        with self._cond:
            self._cond.wait_for(
                lambda: self._completed > completed_pages or self._state is not PrefetchState.RUNNING,
                timeout=timeout_s,
            )
            return PrefetchStatus(self._state, self._completed, self.planned_pages)

    def _discard(self) -> bool:
        with self._cond:
            return self._state is PrefetchState.CANCELLED

    def step(self) -> bool:
        with self._cond:
            if self._state is not PrefetchState.RUNNING:
                return False
            if self.policy is PrefetchPolicy.TIMEOUT and time.monotonic() >= self._deadline:
                self._finish(PrefetchState.TIMED_OUT)
                return False
            batch = self._keys[self._cursor : self._cursor + self._batch]
            self._cursor += len(batch)
            self._in_flight = True
        got, ok = 0, False
        try:
            got, ok = self._fetch(batch, self._discard)
        finally:
            with self._cond:
                self._in_flight = False
                self._completed += got
                if self._state is PrefetchState.RUNNING:
                    if not ok:
                        self._finish(PrefetchState.FAILED)
                    elif self._cursor >= len(self._keys):
                        self._finish(PrefetchState.DONE)
                self._cond.notify_all()
        with self._cond:
            return self._state is PrefetchState.RUNNING

    def _finish(self, state: PrefetchState) -> None:
        # Caller holds the condition. A finished task is kept for its status (the index keeps
        # the last ones) but never reads its keys again: let them go, or each kept task would
        # hold up to limits.max_keys_per_request strings (~10 MiB a Prefetch, measured).
        if self._state is PrefetchState.RUNNING:
            self._state = state
            self._keys = []
        self._cond.notify_all()

    def abandon(self, reason: BaseException | None) -> None:
        with self._cond:
            self._finish(PrefetchState.FAILED)

    def wait(self, timeout_s: float | None = None) -> PrefetchStatus:
        """Block as the policy says, at most ``timeout_s``, then report (the state so far:
        ``running`` when ``wait_complete`` reached ``timeout_s``).

        ``best_effort`` returns at once (the prefetch continues);
        ``wait_complete`` blocks until it is no longer running; ``timeout``
        blocks until done or the deadline, and at the deadline stops it from
        starting further batches (state ``timed_out``).
        """
        with self._cond:
            if self.policy is PrefetchPolicy.WAIT_COMPLETE:
                self._cond.wait_for(lambda: self._state is not PrefetchState.RUNNING, timeout=timeout_s)
            elif self.policy is PrefetchPolicy.TIMEOUT:
                left = self._deadline - time.monotonic()
                capped = timeout_s is not None and timeout_s < left
                self._cond.wait_for(
                    lambda: self._state is not PrefetchState.RUNNING,
                    timeout=max(0.0, timeout_s if capped and timeout_s is not None else left),
                )
                if not capped:  # the prefetch's own deadline passed, not only this wait's
                    self._finish(PrefetchState.TIMED_OUT)
            return PrefetchStatus(self._state, self._completed, self.planned_pages)

    def cancel(self, wait: bool = True, timeout_s: float | None = None) -> int:
        """Stop the prefetch; pages fetched but not yet published are freed.

        Returns the pages completed (published) before the cancel. Cancelling
        a finished prefetch changes nothing. With ``wait``, waits at most
        ``timeout_s`` for a batch in flight; ``wait=False`` (or past the
        deadline) returns at once: a batch in flight then frees its pages
        itself when its L3 read returns.
        """
        with self._cond:
            self._finish(PrefetchState.CANCELLED)
            if wait:
                self._cond.wait_for(lambda: not self._in_flight, timeout_s)
            return self._completed


E = TypeVar("E")


class BackupJob(Generic[E]):
    """An ordered L2 -> L3 backup of entries, in batches; stops at the first failed batch.

    ``store(batch) -> (stored, ok)`` writes one batch; ``release(entries,
    attempted)`` is called exactly once per entry, after ``store`` returned
    for its batch (``attempted`` True) or when the job stopped before
    reaching it or ``store`` raised (``attempted`` False), so the index can
    drop the holds it took and count what was dropped.
    """

    def __init__(
        self,
        batches: Sequence[Sequence[E]],
        *,
        store: Callable[[Sequence[E]], tuple[int, bool]],
        release: Callable[[Sequence[E], bool], None],
    ) -> None:
        self.queued_pages = sum(len(b) for b in batches)
        self._batches = collections.deque(batches)
        self._store = store
        self._release = release
        self._done = threading.Event()
        self._stored = 0
        self.failed = False

    @property
    def stored_pages(self) -> int:
        return self._stored

    def step(self) -> bool:
        batch = self._batches.popleft()
        stored, ok, returned = 0, False, False
        try:
            stored, ok = self._store(batch)
            returned = True
        finally:
            self._stored += stored
            # A store that raised accounted for nothing: its batch counts as dropped.
            self._release(batch, returned)
            if not ok:
                self._stop()
        if not self._batches:
            self._done.set()
            return False
        return True

    def _stop(self) -> None:
        self.failed = True
        rest = [e for b in self._batches for e in b]
        self._batches.clear()
        if rest:
            self._release(rest, False)
        self._done.set()

    def abandon(self, reason: BaseException | None) -> None:
        self._stop()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the job is finished; False on timeout."""
        return self._done.wait(timeout_s)
