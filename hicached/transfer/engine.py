"""The node-wide copy scheduler: every page copy of every worker goes through one engine.

Requests queue per priority and, inside a priority, per submitter (owner), served
fairly by bytes so one busy worker cannot starve another. The queue is bounded in
bytes: a request that does not fit is refused at once with ResourceExhausted and a
retry hint, never queued without limit. Worker threads do the copies; torch releases
the GIL inside its kernels, so copies of different requests run in parallel.

A caller that waits for its copy anyway (:meth:`CopyEngine.run`, every RPC) runs it on its
own thread when a copy slot is free and nothing is queued: the hand-off to a worker thread
and back cost 0.1-3 ms per call on a loaded 2-core machine, more than a 1 MiB copy. The
engine still counts such a copy as running (slots, cancellation, shutdown), so at most
``workers`` copies run at once whichever thread does them.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hicached.errors import Cancelled, InvalidArgument, ResourceExhausted, Unavailable
from hicached.transfer.plan import CopyPlan, PageCopy
from hicached.transfer.routes import CopyContext, run_copies

log = logging.getLogger(__name__)

# Throughput assumed for retry hints until the engine has measured its own.
_INITIAL_RATE_BPS = 4e9
_RATE_SMOOTHING = 0.2


class Priority(enum.IntEnum):
    """Lower runs first: a retracted request's restore blocks a decode, write-back blocks nobody."""

    RESTORE = 0
    DEMAND = 1
    PREFETCH = 2
    WRITE_BACK = 3


@dataclass(frozen=True)
class CopyResult:
    nbytes: int
    seconds: float


class _Job:
    """One copy. ``future``: a queued job's (a copy run on its caller's thread has none: a
    Future and its condition cost more than planning a small copy). ``stop_error``: set by
    cancel_owner()/close() to stop a running job at its next layer (read without the lock:
    one attribute store)."""

    __slots__ = ("cancel", "future", "on_layer", "owner", "plan", "priority", "ready", "seq", "stop_error")

    def __init__(
        self,
        plan: CopyPlan,
        priority: Priority,
        owner: str,
        on_layer: Callable[[int], None] | None,
        ready: Callable[[], None] | None,
        cancel: threading.Event | None,
        seq: int,
        future: Future[CopyResult] | None = None,
    ) -> None:
        self.plan = plan
        self.priority = priority
        self.owner = owner
        self.on_layer = on_layer
        self.ready = ready
        self.cancel = cancel
        self.seq = seq
        self.future = future
        self.stop_error: Exception | None = None


class _FairQueue:
    """The queued jobs of one priority, served fairly by bytes across owners.

    Start-time fair queuing: each owner with queued work carries the bytes it has
    been served; the owner with the least goes next (ties in arrival order), so an
    owner of large copies gets the same bandwidth as one of many small copies. An
    owner that (re)joins starts no lower than the current virtual time, so idle time
    cannot be banked. An owner's account lives until :meth:`remove_owner` (its
    session ended). Not thread-safe: guarded by the engine's lock.
    """

    def __init__(self) -> None:
        self._jobs: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._served: dict[str, int] = {}
        self._vtime = 0
        self.count = 0

    def push(self, job: _Job) -> None:
        jobs = self._jobs.get(job.owner)
        if jobs is None:
            jobs = self._jobs[job.owner] = deque()
            self._served[job.owner] = max(self._served.get(job.owner, 0), self._vtime)
        jobs.append(job)
        self.count += 1

    def pop(self) -> _Job | None:
        if not self._jobs:
            return None
        owner = min(self._jobs, key=self._served.__getitem__)  # first of equals: arrival order
        jobs = self._jobs[owner]
        job = jobs.popleft()
        self.count -= 1
        self._vtime = max(self._vtime, self._served[owner])
        self._served[owner] += job.plan.nbytes
        if jobs:
            self._jobs.move_to_end(owner)
        else:
            del self._jobs[owner]  # its served bytes stay until remove_owner()
        return job

    def remove_owner(self, owner: str) -> list[_Job]:
        self._served.pop(owner, None)
        jobs = self._jobs.pop(owner, None)
        if jobs is None:
            return []
        self.count -= len(jobs)
        return list(jobs)

    def drain(self) -> list[_Job]:
        jobs = [job for d in self._jobs.values() for job in d]
        self._jobs.clear()
        self._served.clear()
        self.count = 0
        return jobs


class CopyEngine:
    """Node-wide scheduler of every page copy.

    Bounded queue (bytes), priority order, fair by bytes across owners of the same
    priority (see :class:`_FairQueue`), ``workers`` threads that do the copies. Thread-safe. The engine owns
    its threads and their staging buffers; the tensors in submitted plans are
    borrowed and must stay valid until the returned future is done.
    """

    def __init__(self, workers: int = 2, max_queued_bytes: int = 1 << 30) -> None:
        if type(workers) is not int or workers < 1:
            raise InvalidArgument(f"copy engine workers must be a positive int, got {workers!r}")
        if type(max_queued_bytes) is not int or max_queued_bytes < 1:
            raise InvalidArgument(f"max_queued_bytes must be a positive int, got {max_queued_bytes!r}")
        self._max_queued_bytes = max_queued_bytes
        self._cv = threading.Condition()
        self._queues: dict[Priority, _FairQueue] = {p: _FairQueue() for p in Priority}
        self._queued_bytes = 0
        self._running: set[_Job] = set()
        self._slots = workers  # copies that may run at once, on workers or on callers
        self._contexts: list[CopyContext] = []  # idle contexts of copies run on callers' threads
        self._closed = False
        self._rate_bps = _INITIAL_RATE_BPS
        self._seq = itertools.count()
        self._threads = [
            threading.Thread(target=self._worker, name=f"hicached-copy-{i}", daemon=True)
            for i in range(workers)
        ]
        # Threads that split a worker's large numpy gathers/scatters, so one copy uses
        # as many cores as torch's own index ops would (its intra-op thread count).
        # Created on first use, joined by close().
        self._parallelism = max(1, torch.get_num_threads())
        self._helpers = (
            ThreadPoolExecutor((self._parallelism - 1) * workers, thread_name_prefix="hicached-copy-helper")
            if self._parallelism > 1
            else None
        )
        for t in self._threads:
            t.start()

    # -- submission ---------------------------------------------------------------------------

    def submit(
        self,
        plan: CopyPlan,
        *,
        priority: Priority,
        owner: str,
        on_layer: Callable[[int], None] | None = None,
        ready: Callable[[], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Future[CopyResult]:
        """Queue ``plan``; the future resolves to a CopyResult or to the error that stopped it.

        ``ready`` runs on the copy thread before the first source byte is read (the
        worker's fence); ``on_layer(layer)`` after each step's copies are complete;
        setting ``cancel`` stops the job before its next step (the future then raises
        Cancelled). Raises ResourceExhausted (with ``retry_after_ms``) when the queue
        holds too many bytes, Unavailable after :meth:`close`. A plan larger than the
        whole budget is accepted when the queue is empty, so it can still make progress.
        """
        priority = _check_args(priority, owner)
        with self._cv:
            if self._closed:
                raise Unavailable("copy engine is shut down")
            if self._queued_bytes and self._queued_bytes + plan.nbytes > self._max_queued_bytes:
                excess = self._queued_bytes + plan.nbytes - self._max_queued_bytes
                retry_ms = max(1, math.ceil(1000 * excess / self._rate_bps))
                raise ResourceExhausted(
                    f"copy queue holds {self._queued_bytes} bytes; {plan.nbytes} more exceed the "
                    f"limit of {self._max_queued_bytes}",
                    retry_after_ms=retry_ms,
                )
            future: Future[CopyResult] = Future()
            job = _Job(plan, priority, owner, on_layer, ready, cancel, next(self._seq), future)
            self._queues[priority].push(job)
            self._queued_bytes += plan.nbytes
            self._cv.notify()
        return future

    def run(
        self,
        plan: CopyPlan,
        *,
        priority: Priority,
        owner: str,
        on_layer: Callable[[int], None] | None = None,
        ready: Callable[[], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> CopyResult:
        """Copy ``plan`` and wait for it; the arguments, errors and callbacks are :meth:`submit`'s.

        When a copy slot is free and no job is queued (so none waits for that slot),
        the copy runs on the calling thread, callbacks included: no hand-off to a
        worker thread and back. Otherwise it is queued and waited for. The error it raises
        refers back to no job of the engine, so the plan's tensors (borrowed: the caller's)
        are released as soon as the caller drops the error, not by the cyclic collector.
        """
        priority = _check_args(priority, owner)
        with self._cv:
            if self._closed:
                raise Unavailable("copy engine is shut down")
            inline = len(self._running) < self._slots and not self._queued()
            if inline:
                job = _Job(plan, priority, owner, on_layer, ready, cancel, next(self._seq))
                self._running.add(job)
                ctx = self._contexts.pop() if self._contexts else None
        if not inline:
            return self.submit(
                plan, priority=priority, owner=owner, on_layer=on_layer, ready=ready, cancel=cancel
            ).result()
        if ctx is None:
            ctx = CopyContext(helpers=self._helpers, parallelism=self._parallelism)
        try:
            outcome = self._run(job, ctx)
        finally:
            with self._cv:
                self._running.discard(job)
                closed = self._closed
                if not closed:
                    self._contexts.append(ctx)
                self._wake_for_queued()
            if closed:
                ctx.close()
            # A failed copy's error keeps this frame in its traceback: were the frame to keep
            # the error too (the job holds stop_error), the two would form a cycle that holds
            # the plan -- the session's device views, and so its mappings -- and the caller's
            # frames until the cyclic collector runs, long after the session ended.
            del job
        if isinstance(outcome, BaseException):
            try:
                raise outcome
            finally:
                del outcome
        return outcome

    def cancel_owner(self, owner: str) -> int:
        """Cancel every queued job of ``owner`` (its session ended) and stop its running ones.

        Queued jobs fail with Cancelled at once; running jobs stop before their next
        layer and fail with Cancelled. Returns how many queued jobs were cancelled.
        """
        err = Cancelled(f"copies of {owner!r} cancelled")
        with self._cv:
            dropped = [job for queue in self._queues.values() for job in queue.remove_owner(owner)]
            self._queued_bytes -= sum(j.plan.nbytes for j in dropped)
            for job in self._running:
                if job.owner == owner:
                    job.stop_error = err
        for job in dropped:
            _fail(job, err)
        return len(dropped)

    def queue_depth(self) -> dict[Priority, int]:
        """Queued (not yet started) jobs per priority."""
        with self._cv:
            return {p: q.count for p, q in self._queues.items()}

    @property
    def queued_bytes(self) -> int:
        with self._cv:
            return self._queued_bytes

    def close(self) -> None:
        """Refuse new work, fail queued jobs with Unavailable, stop running ones, join threads.

        Idempotent. Running jobs stop at their next layer boundary.
        """
        err = Unavailable("copy engine is shut down")
        with self._cv:
            self._closed = True
            dropped = [job for q in self._queues.values() for job in q.drain()]
            self._queued_bytes = 0
            for job in self._running:
                job.stop_error = err
            self._cv.notify_all()
            idle, self._contexts = self._contexts, []
        for ctx in idle:
            ctx.close()
        for job in dropped:
            _fail(job, err)
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join()
        if self._helpers is not None:
            self._helpers.shutdown(wait=me not in self._threads)

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker side --------------------------------------------------------------------------

    def _queued(self) -> bool:
        return any(q.count for q in self._queues.values())

    def _wake_for_queued(self) -> None:
        """A slot was freed: wake a worker if a job waits for it (never for nothing: a woken
        thread costs the freeing caller its core on a loaded machine). Holds ``_cv``."""
        if self._queued():
            self._cv.notify()

    def _next_job(self) -> _Job | None:
        with self._cv:
            while True:
                if self._closed:
                    return None
                if len(self._running) >= self._slots:  # copies run on callers' threads hold them
                    self._cv.wait()
                    continue
                for queue in self._queues.values():  # Priority order: dicts keep insertion order
                    job = queue.pop()
                    if job is not None:
                        self._queued_bytes -= job.plan.nbytes
                        self._running.add(job)
                        return job
                self._cv.wait()

    def _worker(self) -> None:
        ctx = CopyContext(helpers=self._helpers, parallelism=self._parallelism)
        try:
            while (job := self._next_job()) is not None:
                try:
                    self._serve(job, ctx)
                finally:
                    with self._cv:
                        self._running.discard(job)
                        self._wake_for_queued()
                # Drop the plan now: it borrows session memory, which must not stay
                # referenced while this thread waits for the next job.
                del job
        finally:
            ctx.close()

    def _serve(self, job: _Job, ctx: CopyContext) -> None:
        """A worker thread's copy of a queued job: its outcome goes to the job's future.

        A failed copy's traceback holds _run's frame and, through it, this one: neither the
        job nor this frame may then keep the error (the job's future, ``outcome``), or the
        two would be a cycle holding the plan -- a session's mapped buffers -- until the
        cyclic collector runs."""
        future, job.future = job.future, None  # running: nothing else reads it (close, cancel)
        assert future is not None  # every queued job has one (submit)
        if not future.set_running_or_notify_cancel():
            return
        outcome = self._run(job, ctx)
        try:
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
                if not isinstance(outcome, Exception):
                    raise outcome
            else:
                future.set_result(outcome)
        finally:
            del outcome, future

    def _run(self, job: _Job, ctx: CopyContext) -> CopyResult | BaseException:
        """Copy ``job``'s plan; the error that stopped it is returned, not raised (the caller
        reports it: to the waiting caller, or through the future)."""
        start = time.perf_counter()
        try:
            self._check_stop(job)
            if job.ready is not None:
                job.ready()
            for layers, copies, nbytes in _batches(job.plan, merge=job.on_layer is None):
                self._check_stop(job)
                run_copies(copies, ctx, nbytes=nbytes)
                ctx.flush()
                if job.on_layer is not None:
                    for layer in layers:
                        job.on_layer(layer)
        except BaseException as exc:
            ctx.settle()  # copies already issued must end before the caller hears of it
            if isinstance(exc, Cancelled | Unavailable):
                # Expected, and its traceback would hold this frame, the job and its callbacks
                # (a lane's on_layer, which maps its ring) in a cycle until the collector runs.
                exc.__traceback__ = None
            elif isinstance(exc, Exception):
                # Its text, not the error: a handler that keeps records (a queue, a test's
                # capture) would keep the traceback, so this frame and the plan.
                log.warning("copy of %s (%d bytes) failed: %s", job.owner, job.plan.nbytes, str(exc))
            return exc
        seconds = time.perf_counter() - start
        self._observe(job.plan.nbytes, seconds)
        return CopyResult(nbytes=job.plan.nbytes, seconds=seconds)

    @staticmethod
    def _check_stop(job: _Job) -> None:
        if job.stop_error is not None:
            raise job.stop_error
        if job.cancel is not None and job.cancel.is_set():
            raise Cancelled(f"copy of {job.owner!r} cancelled by its caller")

    def _observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._cv:
            self._rate_bps += _RATE_SMOOTHING * (nbytes / seconds - self._rate_bps)


# Without progress reports, consecutive layers are copied as one set of up to this many bytes
# (one hand-off to the helper threads per set); cancellation is checked between sets.
MERGE_BYTES = 64 << 20


def _batches(plan: CopyPlan, *, merge: bool) -> list[tuple[list[int], list[PageCopy], int]]:
    """(layers, copies, bytes) to run in order: one per step, or merged steps when ``merge``."""
    out: list[tuple[list[int], list[PageCopy], int]] = []
    for step in plan.steps:
        nbytes = step.nbytes if step.nbytes is not None else sum(c.nbytes for c in step.copies)
        if merge and out and out[-1][2] + nbytes <= MERGE_BYTES:
            layers, copies, size = out[-1]
            layers.append(step.layer)
            copies.extend(step.copies)
            out[-1] = (layers, copies, size + nbytes)
        else:
            out.append(([step.layer], list(step.copies), nbytes))
    return out


def _check_args(priority: Priority, owner: str) -> Priority:
    if type(priority) is Priority and type(owner) is str and owner:
        return priority  # the core's calls: no enum conversion (it costs more than the checks)
    try:
        priority = Priority(priority)
    except ValueError:
        raise InvalidArgument(f"unknown copy priority {priority!r}") from None
    if not isinstance(owner, str) or not owner:
        raise InvalidArgument(f"copy owner must be a non-empty string, got {owner!r}")
    return priority


def _fail(job: _Job, err: Exception) -> None:
    """A queued job (it has a future) that will not run."""
    if job.future is not None and job.future.set_running_or_notify_cancel():
        job.future.set_exception(err)
