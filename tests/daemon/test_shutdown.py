"""Issue 5: SIGTERM while a large streaming load is in flight.

The daemon exits 0 within 10 s, removes its socket and every shared-memory segment of
its prefix, and loses nothing from L3: the pages ``backup(wait=True)`` acknowledged before
the signal are found by a daemon restarted on the same directory and read back byte-exact.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from hicached_client import (
    HiCacheClient,
    HiCacheError,
    LoadProgress,
    TokenChain,
    Transfer,
    WorkerIdentity,
    pool_spec,
)
from hicached_client.export import ShmKVPool
from hicached_client.v1 import types_pb2 as tpb

from tests.daemon.conftest import free_port, scrape, start_file_daemon, total
from tests.support.daemon import Daemon
from tests.support.kv import WorkerPools, host_pages_of, transfers, unique_tag

PAGE_SIZE = 4
LAYERS, HEADS, DIM = 16, 4, 32  # float16 K and V: 32 KiB per page, 2 KiB per page and layer
LOAD_PAGES = 4096  # 128 MiB: the load in flight at the signal
DEVICE_PAGES = 2 * LOAD_PAGES  # source pages, then the load's destination pages
ACKED = 512  # pages backed up to L3 before the signal
MODEL = "m-shutdown"
EXIT_WITHIN_S = 10.0


class BigWorker:
    """One anchor pool ``kv`` in a shared-memory "device" segment owned by the test."""

    def __init__(self) -> None:
        self.tag = unique_tag("shut")
        self.kv = ShmKVPool(
            f"hct-{self.tag}-kv", num_layers=LAYERS, tokens=DEVICE_PAGES * PAGE_SIZE, heads=HEADS,
            head_dim=DIM, dtype=torch.float16,
        )  # fmt: skip

    def specs(self) -> list[tpb.PoolSpec]:
        return [
            pool_spec(
                "kv", role="anchor", kind="mha", dtype="float16", host_layout="layer_first",
                page_size=PAGE_SIZE, num_layers=LAYERS, num_heads=HEADS, head_dim=DIM,
                k_buffers=self.kv.k_buffers(), v_buffers=self.kv.v_buffers(), host_ratio=0.5,
            )
        ]  # fmt: skip

    def pages(self, lo: int, hi: int) -> torch.Tensor:
        """Raw bytes of device pages ``lo..hi-1``: (pages, buffers, bytes per page per buffer)."""
        return torch.stack(
            [t.view(torch.uint8).reshape(DEVICE_PAGES, -1)[lo:hi] for t in (*self.kv.k, *self.kv.v)], dim=1
        ).clone()

    def fill_random(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for t in (*self.kv.k, *self.kv.v):
            bits = t.view(torch.int16)
            bits.copy_(torch.randint(-(1 << 15), 1 << 15, bits.shape, generator=gen, dtype=torch.int16))

    def clobber(self) -> None:
        for t in (*self.kv.k, *self.kv.v):
            t.view(torch.int16).fill_(-1)

    def close(self) -> None:
        self.kv.close()
        self.kv.unlink()


@pytest.fixture
def worker() -> Iterator[BigWorker]:
    w = BigWorker()
    try:
        yield w
    finally:
        w.close()


def start(l3: Path) -> Daemon:
    return start_file_daemon(
        l3, "--host-budget", "1GiB",
        "--set", "l3.write_policy=write_through_selective",  # only backup() puts pages in L3
        "--set", f"server.max_batch_pages={LOAD_PAGES}",
    )  # fmt: skip


class LoadInFlight(threading.Thread):
    """Consumes one load stream; SIGTERMs the daemon as soon as the first layer is reported."""

    def __init__(self, stream: Iterator[LoadProgress], pid: int) -> None:
        super().__init__(name="load-in-flight", daemon=True)
        self._stream, self._pid = stream, pid
        self.signalled = threading.Event()
        self.signalled_at = 0.0
        self.progress: list[LoadProgress] = []
        self.error: HiCacheError | None = None

    def run(self) -> None:
        try:
            for item in self._stream:
                self.progress.append(item)
                if not self.signalled.is_set():
                    self.signalled_at = time.monotonic()
                    os.kill(self._pid, signal.SIGTERM)
                    self.signalled.set()
        except HiCacheError as exc:
            self.error = exc
        finally:
            self.signalled.set()


def test_sigterm_during_a_large_load_exits_0_and_keeps_l3(tmp_path: Path, worker: BigWorker) -> None:
    l3 = tmp_path / "l3"
    chain = TokenChain(list(range(ACKED * PAGE_SIZE)), cache_salt="tenant-shutdown")
    worker.fill_random(71)
    expected_acked = worker.pages(0, ACKED)
    expected_load = worker.pages(0, LOAD_PAGES)

    first = start(l3)
    sock = Path(first.target.removeprefix("unix://"))
    try:
        with HiCacheClient(first.target, timeout_s=60.0) as client:
            ident = WorkerIdentity(worker.tag, generation=1, model_name=MODEL)
            session = client.attach(ident, worker.specs(), heartbeat=False)
            put = session.put_pages(chain, [Transfer("kv", list(range(ACKED)))])
            assert (put.ok, put.stored_pages) == (True, ACKED)
            acked = session.backup(chain, wait=True)
            assert (acked.queued_pages, acked.stored_pages) == (ACKED, ACKED)

            written = session.write([Transfer("kv", list(range(LOAD_PAGES)))], allocate=True)
            assert written.ok
            host = host_pages_of(written.transfers)["kv"]
            assert len(host) == LOAD_PAGES
            dst = list(range(LOAD_PAGES, 2 * LOAD_PAGES))
            stream = session.load([Transfer("kv", dst, host)], layer_progress=True)
            load = LoadInFlight(stream, first.process.pid)
            load.start()
            assert load.signalled.wait(timeout=60), "the load reported no progress"
            assert load.progress, f"the load failed before any progress: {load.error}"
            assert not load.progress[0].done, "the signal went out while the load was in flight"
            code = first.process.wait(timeout=30)
            took = time.monotonic() - load.signalled_at
            load.join(timeout=30)
            assert not load.is_alive(), "the client's load stream never ended"
        assert code == 0, f"exit code {code}\n{first.log}"
        assert took < EXIT_WITHIN_S, f"exit took {took:.2f} s"
        # The in-flight load either finished within the grace period or was cut off with a status.
        if load.error is None:
            assert load.progress[-1].done
            assert torch.equal(worker.pages(LOAD_PAGES, 2 * LOAD_PAGES), expected_load)
        else:
            assert load.error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), load.error
        assert not sock.exists(), "the socket file was left behind"
        left = sorted(p.name for p in Path("/dev/shm").glob(f"{first.shm_prefix}*"))
        assert not left, f"shared-memory segments left behind: {left}"
    finally:
        first.stop()

    worker.clobber()
    second = start(l3)
    try:
        with HiCacheClient(second.target, timeout_s=60.0) as client:
            ident = WorkerIdentity(unique_tag("reader"), generation=1, model_name=MODEL)
            with client.attach(ident, worker.specs()) as session:
                found = session.lookup(chain)
                assert (found.l2_hit_pages, found.total_hit_pages) == (0, ACKED), "acknowledged pages lost"
                got = session.get_pages(chain, [Transfer("kv", list(range(ACKED)))], include_l3=True)
                assert got.hit_pages == ACKED
                assert torch.equal(worker.pages(0, ACKED), expected_acked), "L3 pages read back wrong"
    finally:
        second.stop()


def test_sigint_with_an_attached_session_exits_0_and_releases_everything(tmp_path: Path) -> None:
    pools = WorkerPools.create(unique_tag("sigint"))
    port = free_port()
    daemon = start_file_daemon(tmp_path / "l3", "--metrics-port", str(port))
    sock = Path(daemon.target.removeprefix("unix://"))
    try:
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            ident = WorkerIdentity(unique_tag("sigint"), generation=1, model_name=MODEL)
            session = client.attach(ident, pools.specs(), heartbeat=False)
            assert session.write(transfers(range(8)), allocate=True).ok
            assert list(Path("/dev/shm").glob(f"{daemon.shm_prefix}*")), "the daemon's host pools exist"
            assert total(scrape(port), "hicached_sessions") == 1
            sent = time.monotonic()
            daemon.process.send_signal(signal.SIGINT)
            code = daemon.process.wait(timeout=30)
            took = time.monotonic() - sent
        assert code == 0, f"exit code {code}\n{daemon.log}"
        assert took < EXIT_WITHIN_S, f"exit took {took:.2f} s"
        assert not sock.exists(), "the socket file was left behind"
        left = sorted(p.name for p in Path("/dev/shm").glob(f"{daemon.shm_prefix}*"))
        assert not left, f"shared-memory segments left behind: {left}"
        with pytest.raises(ConnectionRefusedError):  # /metrics stopped listening
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        daemon.stop()
        pools.close()
