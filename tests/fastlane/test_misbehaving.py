"""Lanes whose client misbehaves, or whose session ends mid-copy, against real daemons: the
lane still ends when it should and gives back everything it held, and no other client waits."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError, Transfer, WorkerIdentity, pool_spec
from hicached_client import lane_wire as w
from hicached_client.export import ShmKVPool
from hicached_client.fastlane import FastLane, lane_path

import hicached.server.lane as lane_module
from tests.fastlane.conftest import Worker
from tests.support.daemon import Daemon, start_daemon
from tests.support.state import fd_links, poll

LAYERS, PAGE, PAGES = 32, 16, 64


def eventfds(daemon: Daemon) -> int:
    return fd_links(daemon.process.pid).count("anon_inode:[eventfd]")


def lane_rings(daemon: Daemon) -> int:
    return Path(f"/proc/{daemon.process.pid}/maps").read_text().count("memfd:hicached-lane")


@pytest.fixture
def deep_pool() -> Iterator[ShmKVPool]:
    """32 layers: a layer-by-layer Load of 64 pages takes long enough to end its session mid-copy."""
    pool = ShmKVPool(
        f"deep-{uuid.uuid4().hex[:8]}", num_layers=LAYERS, tokens=PAGE * 2 * PAGES, heads=8, head_dim=64,
        dtype=torch.float16,
    )  # fmt: skip
    try:
        yield pool
    finally:
        pool.close()
        pool.unlink()


def test_a_session_ended_during_a_layered_load_gives_back_all_its_lane_held(deep_pool: ShmKVPool) -> None:
    d = start_daemon("--host-budget", "256MiB", "--set", "server.fast_lane_max_per_uid=2")
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            spec = pool_spec(
                "kv", role="anchor", kind="mha", dtype="float16", page_size=PAGE, num_layers=LAYERS,
                num_heads=8, head_dim=64, k_buffers=deep_pool.k_buffers(), v_buffers=deep_pool.v_buffers(),
                host_ratio=1.0,
            )  # fmt: skip
            baseline = poll(lambda: (eventfds(d), lane_rings(d)), lambda r: r[1] == 0, 10, "no lane yet")
            for _ in range(2):  # the uid's limit: a leaked slot would refuse the lane below
                session = client.attach(WorkerIdentity(uuid.uuid4().hex[:8], 1, "m-deep"), [spec])
                lane = FastLane.open(session)
                wrote = lane.write([Transfer("kv", list(range(PAGES)))], allocate=True)
                pending = lane.start_load(
                    [Transfer("kv", list(range(PAGES, 2 * PAGES)), wrote.transfers[0].host_pages)]
                )
                pending.wait_layer(0, timeout_s=30)
                session.detach()  # its copies are cancelled mid-load
                with pytest.raises(HiCacheError) as err:
                    pending.result(timeout_s=30)
                assert err.value.code == grpc.StatusCode.CANCELLED, err.value
                lane.close()
            poll(
                lambda: (eventfds(d), lane_rings(d)),
                lambda r: r == baseline,
                10,
                "the lanes' fds and rings freed",
            )
            session = client.attach(WorkerIdentity(uuid.uuid4().hex[:8], 1, "m-deep"), [spec])
            FastLane.open(session).close()  # both slots were given back
            session.detach()
        assert "fast lane failed" not in d.log and "BufferError" not in d.log, d.log[-3000:]
    finally:
        d.stop()


def test_full_doorbells_fail_neither_the_load_nor_the_lane(worker: Worker) -> None:
    lane = worker.lane
    wrote = lane.write([Transfer("kv", [1, 2])], allocate=True)
    # The client owns its eventfds: filled to the brim, the daemon's next write would block.
    for fd in (lane._layer, lane._done):
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(fd)
        os.eventfd_write(fd, 0xFFFFFFFFFFFFFFFE)
    loaded = lane.load([Transfer("kv", [3, 4], wrote.transfers[0].host_pages)], layer_progress=True)
    assert loaded.layers == tuple(range(len(worker.pools.kv.k)))
    again = lane.write([Transfer("kv", [5])], allocate=True)
    assert again.ok
    lane.release_transfers(list(wrote.transfers))
    lane.release_transfers(list(again.transfers))


def slow_record(view: memoryview, offset: int) -> None:
    """A GetPages record of 65,536 eight-byte keys (within every limit): milliseconds to
    decode, so a client moving its tail keeps requests pending all the time."""
    n = 1 << 16
    w.REQUEST.pack_into(view, offset, w.REQUEST_MAGIC, w.VERSION, w.Opcode.GET_PAGES, 0, 0, 0, b"slow")
    body = struct.pack(f"<I{n}H", n, *([8] * n)) + b"k" * (8 * n)
    view[offset + w.REQUEST.size : offset + w.REQUEST.size + len(body)] = body


def test_a_lane_kept_busy_by_its_client_still_ends_with_its_session(worker: Worker, daemon: Daemon) -> None:
    rings = lane_rings(daemon)
    lane = worker.lane
    counters = lane._counters
    for slot in range(w.SLOTS):
        slow_record(lane._view, w.request_offset(slot))
    stop = threading.Event()

    def keep_busy() -> None:  # the tail always a ring ahead of the completions
        while not stop.is_set():
            counters[w.SQ_TAIL // 8] = int(counters[w.CQ_TAIL // 8]) + w.SLOTS

    spinner = threading.Thread(target=keep_busy, daemon=True)
    spinner.start()
    try:
        poll(
            lambda: int(counters[w.CQ_TAIL // 8]), lambda n: n > w.SLOTS, 10, "the daemon serving the records"
        )
        worker.session.detach()
        poll(lambda: lane_rings(daemon), lambda n: n < rings, 10, "the busy lane ended with its session")
    finally:
        stop.set()
        spinner.join(10)


def _negotiation(worker: Worker, daemon: Daemon) -> tuple[str, bytes]:
    """The lane socket's path and the worker's negotiation line (without its newline)."""
    path = lane_path(daemon.target)
    assert path is not None
    return path, b" ".join(
        [w.NEGOTIATE_MAGIC, worker.session.session_id.encode(), worker.session.info.session_secret.encode()]
    )


def test_a_negotiation_line_sent_a_byte_at_a_time_past_the_deadline_is_refused(
    worker: Worker, daemon: Daemon
) -> None:
    path, line = _negotiation(worker, daemon)
    with socket.socket(socket.AF_UNIX) as s:
        # Before the connect: the daemon's deadline starts when it accepts, which may come before
        # connect() returns here (a CI run measured 1.999 s from after it).
        started = time.monotonic()
        s.connect(path)
        poller = select.poll()
        poller.register(s, select.POLLIN)
        for byte in line + b"\n":  # each byte well within a recv timeout, the whole line past it
            try:
                s.send(bytes([byte]))
            except OSError:  # refused and closed: the answer is waiting
                break
            if poller.poll(50):  # the attack's pace: the next byte 50 ms on, unless answered first
                break
        s.settimeout(10)
        answer = s.recv(512)
    assert time.monotonic() - started > lane_module.NEGOTIATE_TIMEOUT_S  # the line took longer
    assert answer.startswith(b"error DEADLINE_EXCEEDED"), answer


def test_bytes_after_the_negotiation_line_are_refused_at_once(worker: Worker, daemon: Daemon) -> None:
    """Before: the line was only seen when the data read ended with it, so a valid line with
    anything after it in the same send waited out the whole deadline and was answered
    "no negotiation line" (2.0 s, reviewer's measure)."""
    path, line = _negotiation(worker, daemon)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(line + b"\nX")
        s.settimeout(10)
        started = time.monotonic()
        answer = s.recv(512)
    assert answer.startswith(b"error INVALID_ARGUMENT") and b"after the negotiation line" in answer, answer
    assert time.monotonic() - started < lane_module.NEGOTIATE_TIMEOUT_S
