"""Fast-lane benchmark: a real daemon, this process as its worker, measured beside the
machine's own round-trip limit in the same run.

* ``uds_pingpong_us``: a 64-byte message to another process over a Unix socket and back
  (blocking recv on both sides: what any wake-up-driven IPC costs here).
* ``fastlane_ping_us``: a lane round trip that does no work in the daemon (ring + doorbells).
* ``fastlane_rtt_us``: a Write of one 64 KiB page into host pages the session owns, through
  the lane; ``grpc_write_rtt_us``: the same Write over gRPC. ``*_spin_us``: the lane with the
  worker spinning up to 50 us on the completion counter before sleeping (``FastLane.spin_us``).
* ``fastlane_resolve_rtt_us`` / ``resolve_rtt_grpc_us``: ResolveTransfers of 8 pages (released
  after each call, not timed).
* ``layer_signal_us``: from the daemon's timestamp of a layer's copy finishing (taken right
  after the copy, before the ring store) to the worker, spinning on the ring's counter, seeing
  it (both CLOCK_MONOTONIC); median over every layer of every load, ``layer_signal_p99_us``.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from hicached_client import HiCacheClient, ResolveResult, Session, Transfer, WorkerIdentity, pool_spec
from hicached_client.export import ShmKVPool
from hicached_client.fastlane import FastLane

from hicached.bench.daemon import HEAD_DIM, HEADS, LAYERS, PAGE, running_daemon

DEVICE_PAGES = 256
SPIN_US = 50.0
_ECHO = (
    "import socket, sys\n"
    "s = socket.socket(fileno=int(sys.argv[1]))\n"
    "while True:\n"
    "    m = s.recv(64)\n"
    "    if not m:\n"
    "        break\n"
    "    s.sendall(m)\n"
)


def _median_us(fn: Callable[[], object], n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def uds_pingpong_us(n: int) -> float:
    """Median round trip of 64 bytes to an echo process over a Unix socket pair."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, "-c", _ECHO, str(theirs.fileno())], pass_fds=(theirs.fileno(),))
    theirs.close()
    msg = b"x" * 64
    try:

        def once() -> None:
            mine.sendall(msg)
            got = 0
            while got < len(msg):
                got += len(mine.recv(64))

        for _ in range(50):  # warm-up: the child imports nothing, but its first wakeups are slow
            once()
        return _median_us(once, n)
    finally:
        mine.close()
        child.wait(timeout=30)


def run(quick: bool) -> dict[str, float]:
    n = 300 if quick else 2000
    loads = 30 if quick else 200
    out: dict[str, float] = {"uds_pingpong_us": uds_pingpong_us(n)}
    with tempfile.TemporaryDirectory(prefix="hicached-bench-") as tmp:
        pool = ShmKVPool(
            f"hcbench-fl-{uuid.uuid4().hex[:8]}",
            num_layers=LAYERS,
            tokens=DEVICE_PAGES * PAGE,
            heads=HEADS,
            head_dim=HEAD_DIM,
            dtype=torch.bfloat16,
        )
        try:
            with (
                running_daemon(Path(tmp), host_budget="256MiB", l3="none") as target,
                HiCacheClient(target) as client,
            ):
                spec = pool_spec(
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
                    host_ratio=1.0,
                )
                session = client.attach(WorkerIdentity("bench-fl", 1, "bench-fastlane"), [spec])
                with FastLane.open(session) as lane:
                    out.update(_round_trips(session, lane, n))
                    out.update(_layer_signal(lane, loads))
                session.detach()
        finally:
            pool.close()
            pool.unlink()
    out["uds_pingpong_after_us"] = uds_pingpong_us(n)  # the machine's load may have moved meanwhile
    return out


def _round_trips(session: Session, lane: FastLane, n: int) -> dict[str, float]:
    held = lane.write([Transfer("kv", [0])], allocate=True)
    host = held.transfers[0].host_pages
    one = [Transfer("kv", [1], host)]
    for _ in range(50):  # warm-up both paths
        lane.write(one)
        session.write(one)
    out = {
        "fastlane_ping_us": _median_us(lane.ping, n),
        "fastlane_rtt_us": _median_us(lambda: lane.write(one), n),
        "grpc_write_rtt_us": _median_us(lambda: session.write(one), n),
    }
    lane.spin_us = SPIN_US  # the same with the worker spinning before it sleeps on the doorbell
    out["fastlane_ping_spin_us"] = _median_us(lane.ping, n)
    out["fastlane_rtt_spin_us"] = _median_us(lambda: lane.write(one), n)
    lane.spin_us = 0.0
    lane.release_transfers(list(held.transfers))
    eight = [Transfer("kv", list(range(8)))]

    def resolve_rtt(
        resolve: Callable[[], ResolveResult], release: Callable[[ResolveResult], object]
    ) -> float:
        samples = []
        for _ in range(n // 2):
            t0 = time.perf_counter()
            r = resolve()
            samples.append(time.perf_counter() - t0)
            release(r)
        return statistics.median(samples) * 1e6

    out["fastlane_resolve_rtt_us"] = resolve_rtt(
        lambda: lane.resolve_transfers(eight),
        lambda r: lane.release_transfers(list(r.transfers)),
    )
    out["resolve_rtt_grpc_us"] = resolve_rtt(
        lambda: session.resolve_transfers(eight),
        lambda r: session.release_transfers(list(r.transfers)),
    )
    return out


def _layer_signal(lane: FastLane, loads: int) -> dict[str, float]:
    pages = 64
    held = lane.write([Transfer("kv", list(range(pages)))], allocate=True)
    back = [Transfer("kv", list(range(pages, 2 * pages)), held.transfers[0].host_pages)]
    delays: list[float] = []
    for _ in range(loads):
        pending = lane.start_load(back)
        for layer in range(LAYERS):
            landed = pending.wait_layer(layer, spin=True)
            delays.append((time.monotonic_ns() - landed) / 1e3)
        pending.result(timeout_s=30)
    lane.release_transfers(list(held.transfers))
    return {
        "layer_signal_us": statistics.median(delays),
        "layer_signal_p99_us": float(np.percentile(delays, 99)),
    }
