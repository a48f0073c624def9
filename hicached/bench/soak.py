"""Soak: N worker processes of mixed operations against one real daemon for a given time.

Each worker (its own process, its own shared-memory "device" pool, all of one model so they
share one pool group) loops over a weighted mix: write (D2H, host pages allocated) + load
(H2D) + free, alloc + free, retract backup + restore, put_pages / get_pages / lookup of keys
drawn from one key space shared by every worker (more keys than host pages, so the index
evicts), and detach + re-attach. Reported, per operation: p50/p99 latency (ms) of the first
and of the last window (a minute when the run lasts five minutes or more, else a fifth of the
run); the daemon's RSS (MiB) and open fds sampled over the run; and the page accounting once
every worker has detached (every host page free or owned by the content index).

Expected misses (``ok=False``: no host room) are counted, not failures; any HiCacheError
counts as an error of its operation. The figures are latencies under whatever load the
machine carries: compare the first window with the last, not with another machine.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numpy as np

from hicached.bench.daemon import running_daemon

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 64, 16
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2  # 32 KiB (bf16)
DEVICE_PAGES = 256
HOST_RATIO = 4.0  # the group's host pool: 1,024 pages
BATCH = 8  # pages per operation
KEY_SPACE = 3000  # keys shared by all workers, > host pages: the index must evict
MODEL = "soak-model"
SAMPLES = 20  # RSS/fd samples over the run
# operation -> weight in the mix
MIX: dict[str, int] = {
    "write": 4,
    "alloc": 2,
    "retract": 2,
    "put_pages": 3,
    "get_pages": 3,
    "lookup": 3,
    "reattach": 1,
}
DEFAULT_WORKERS = 8
DEFAULT_SECONDS = 600.0
QUICK_SECONDS = 20.0


@dataclass
class WorkerReport:
    """What one worker sends back: (op, start monotonic, seconds) per call, misses, errors."""

    index: int
    samples: list[tuple[str, float, float]] = field(default_factory=list)
    misses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    fatal: str = ""


def _spec(pool: Any) -> Any:
    from hicached_client import pool_spec

    return pool_spec(
        "kv",
        role="anchor",
        kind="mha",
        dtype="bfloat16",
        page_size=PAGE,
        num_layers=LAYERS,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        k_buffers=pool.k_buffers(),
        v_buffers=pool.v_buffers(),
        host_ratio=HOST_RATIO,
    )


class _Worker:
    """One worker's loop (runs in its own process)."""

    def __init__(self, index: int, client: Any, pool: Any, report: WorkerReport) -> None:
        from hicached_client import WorkerIdentity

        self.index, self.client, self.pool, self.report = index, client, pool, report
        self.rng = random.Random(index)
        self.identity = WorkerIdentity(f"soak-{index}", 1, MODEL)
        self.session = client.attach(self.identity, [_spec(pool)])

    def timed(self, op: str, fn: Any) -> Any:
        t0 = time.monotonic()
        out = fn()
        self.report.samples.append((op, t0, time.monotonic() - t0))
        return out

    def pages(self, half: int) -> list[int]:
        lo = half * DEVICE_PAGES // 2
        return [lo + p for p in self.rng.sample(range(DEVICE_PAGES // 2), BATCH)]

    def keys(self) -> list[str]:
        start = self.rng.randrange(0, KEY_SPACE - BATCH)
        return [f"soak-key-{k}" for k in range(start, start + BATCH)]

    def step(self, op: str) -> None:
        from hicached_client import Transfer

        s = self.session
        if op == "write":
            w = self.timed("write", lambda: s.write([Transfer("kv", self.pages(0))], allocate=True))
            if not w.ok:
                self.report.misses["write"] += 1
                return
            host = list(w.transfers[0].host_pages)
            self.timed(
                "load", lambda: s.load_wait([Transfer("kv", self.pages(1), host)], layer_progress=False)
            )
            self.timed("free", lambda: s.free("kv", host))
        elif op == "alloc":
            a = self.timed("alloc", lambda: s.alloc("kv", BATCH))
            if not a.ok:
                self.report.misses["alloc"] += 1
                return
            self.timed("free", lambda: s.free("kv", list(a.host_pages)))
        elif op == "retract":
            rid = uuid.uuid4().hex
            b = self.timed(
                "retract_backup",
                lambda: s.retract_backup(rid, [Transfer("kv", self.pages(0))], BATCH * PAGE),
            )
            if not b.ok:
                self.report.misses["retract_backup"] += 1
                return
            self.timed(
                "retract_restore",
                lambda: s.retract_restore_wait(
                    b.backup_id, [Transfer("kv", self.pages(1))], layer_progress=False
                ),
            )
        elif op == "put_pages":
            r = self.timed("put_pages", lambda: s.put_pages(self.keys(), [Transfer("kv", self.pages(0))]))
            if not r.ok:
                self.report.misses["put_pages"] += 1
        elif op == "get_pages":
            self.timed("get_pages", lambda: s.get_pages(self.keys(), [Transfer("kv", self.pages(1))]))
        elif op == "lookup":
            self.timed("lookup", lambda: s.lookup(self.keys()))
        elif op == "reattach":
            self.timed("detach", s.detach)
            self.session = self.timed("attach", lambda: self.client.attach(self.identity, [_spec(self.pool)]))

    def run(self, seconds: float) -> None:
        from hicached_client import HiCacheError

        ops, weights = list(MIX), list(MIX.values())
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            op = self.rng.choices(ops, weights)[0]
            try:
                self.step(op)
            except HiCacheError as exc:
                self.report.errors[f"{op}: {exc.code.name}"] += 1
        self.session.detach()


def _worker_main(index: int, target: str, seconds: float, barrier: Barrier, out: Any) -> None:
    """Process entry point: attach, wait for every worker, loop for ``seconds``, report."""
    report = WorkerReport(index)
    try:
        import torch
        from hicached_client import HiCacheClient
        from hicached_client.export import ShmKVPool

        with (
            ShmKVPool(
                f"hcsoak-{os.getpid()}-{index}",
                num_layers=LAYERS,
                tokens=DEVICE_PAGES * PAGE,
                heads=HEADS,
                head_dim=HEAD_DIM,
                dtype=torch.bfloat16,
            ) as pool,
            HiCacheClient(target, timeout_s=60.0) as client,
        ):
            worker = _Worker(index, client, pool, report)
            barrier.wait(timeout=300)
            worker.run(seconds)
    except BaseException as exc:  # reported to the parent, which fails the suite
        report.fatal = f"{type(exc).__name__}: {exc}"
        barrier.abort()
    out.put(report)


class _Sampler:
    """Samples the daemon's RSS (MiB) and open fds from /proc every ``period`` seconds."""

    def __init__(self, pid: int, period: float) -> None:
        self.pid, self.period = pid, period
        self.rss: list[float] = []
        self.fds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def sample(self) -> None:
        status = Path(f"/proc/{self.pid}/status").read_text()
        kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        self.rss.append(kb / 1024)
        self.fds.append(float(len(os.listdir(f"/proc/{self.pid}/fd"))))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self) -> _Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def _percentiles(reports: list[WorkerReport], t0: float, seconds: float) -> dict[str, float]:
    window = 60.0 if seconds >= 300 else seconds / 5
    by: dict[tuple[str, str], list[float]] = {}
    for r in reports:
        for op, start, dur in r.samples:
            rel = start - t0
            if rel < window:
                by.setdefault((op, "first"), []).append(dur)
            elif rel >= seconds - window:
                by.setdefault((op, "last"), []).append(dur)
    out: dict[str, float] = {"soak_window_s": window}
    for (op, part), durs in sorted(by.items()):
        arr = np.asarray(durs) * 1e3
        out[f"soak_{op}_{part}_p50_ms"] = float(np.percentile(arr, 50))
        out[f"soak_{op}_{part}_p99_ms"] = float(np.percentile(arr, 99))
        out[f"soak_{op}_{part}_n"] = float(len(durs))
    return out


def _accounting(admin_target: str) -> dict[str, float]:
    """After every worker detached: each host page is free or owned by the content index."""
    from hicached_client import HiCacheClient

    with HiCacheClient(admin_target, timeout_s=60.0) as admin:
        stats = admin.get_stats()
    total = sum(p.total_pages for p in stats.pools())
    free = sum(p.free_pages for p in stats.pools())
    indexed = sum(g.indexed_pages for g in stats.groups)
    return {
        "soak_host_pages_total": float(total),
        "soak_host_pages_free": float(free),
        "soak_host_pages_indexed": float(indexed),
        "soak_host_pages_leaked": float(total - free - indexed),
        "soak_sessions_left": float(len(stats.sessions)),
        "soak_backups_left": float(len(stats.backups)),
    }


def _series(name: str, values: list[float]) -> dict[str, float]:
    """First, max and last, plus five evenly spaced samples (0%, 25%, ..., 100% of the run)."""
    picks = {
        f"{name}_at_{pct}pct": values[round(pct / 100 * (len(values) - 1))] for pct in (0, 25, 50, 75, 100)
    }
    return {f"{name}_max": max(values), **picks}


def run(quick: bool, *, workers: int | None = None, seconds: float | None = None) -> dict[str, float]:
    workers = workers or DEFAULT_WORKERS
    seconds = seconds or (QUICK_SECONDS if quick else DEFAULT_SECONDS)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding gRPC threads
    pids: list[int] = []
    budget = f"{int(DEVICE_PAGES * HOST_RATIO * PAGE_BYTES * 2 // (1 << 20)) + 64}MiB"
    with tempfile.TemporaryDirectory(prefix="hicached-soak-") as tmp:
        workdir = Path(tmp)
        with running_daemon(workdir, host_budget=budget, on_start=pids.append) as target:
            out: Any = ctx.Queue()
            barrier = ctx.Barrier(workers + 1)
            procs = [
                ctx.Process(target=_worker_main, args=(i, target, seconds, barrier, out), name=f"soak-{i}")
                for i in range(workers)
            ]
            for p in procs:
                p.start()
            reports: list[WorkerReport] = []
            try:
                barrier.wait(timeout=300)
                t0 = time.monotonic()
                with _Sampler(pids[0], max(seconds / SAMPLES, 0.5)) as sampler:
                    while len(reports) < workers:
                        try:
                            reports.append(out.get(timeout=seconds + 120))
                        except queue.Empty:
                            raise RuntimeError(
                                f"soak: {workers - len(reports)} workers never reported"
                            ) from None
            except threading.BrokenBarrierError:
                while len(reports) < workers:
                    reports.append(out.get(timeout=60))
            finally:
                for p in procs:
                    p.join(timeout=60)
                    if p.is_alive():
                        p.kill()
            fatal = [f"worker {r.index}: {r.fatal}" for r in reports if r.fatal]
            if fatal:
                raise RuntimeError("soak workers failed: " + "; ".join(fatal))
            results: dict[str, float] = {"soak_workers": float(workers), "soak_seconds": seconds}
            results["soak_ops"] = float(sum(len(r.samples) for r in reports))
            results["soak_errors"] = float(sum(sum(r.errors.values()) for r in reports))
            results["soak_misses"] = float(sum(sum(r.misses.values()) for r in reports))
            results.update(_percentiles(reports, t0, seconds))
            results.update(_series("soak_daemon_rss_mib", sampler.rss))
            results.update(_series("soak_daemon_fds", sampler.fds))
            results.update(_accounting(f"unix://{workdir / 'admin.sock'}"))
            errors: Counter[str] = Counter()
            for r in reports:
                errors.update(r.errors)
            if errors:
                import logging

                logging.getLogger(__name__).warning("errors by operation and code: %s", dict(errors))
    return results
