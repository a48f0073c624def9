"""Crash test: SIGKILL the daemon during a large L2 -> L3 backup to the file backend,
restart it on the same directory; every page acknowledged before the kill reads back
byte-exact, and no page that is served is ever partial or wrong."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hicached_client import HiCacheClient, Transfer, WorkerIdentity, pool_spec
from hicached_client.export import ShmKVPool
from hicached_client.v1 import types_pb2 as tpb

from hicached.page_keys import page_keys
from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import unique_tag

PAGE_SIZE = 4
LAYERS, HEADS, DIM = 8, 8, 64  # float16 K and V: 64 KiB per 4-token page
PAGES = 2048  # 128 MiB of KV: a backup of it takes many 128-page batches
CHUNK = 512  # pages per RPC (the daemon's server.max_batch_pages)
ACKED = 512
MODEL = "m-crash"


class BigWorker:
    """One anchor pool ``kv`` of 64 KiB pages in a shared-memory "device" segment."""

    def __init__(self) -> None:
        self.tag = unique_tag("crash")
        self.kv = ShmKVPool(
            f"hct-{self.tag}-kv", num_layers=LAYERS, tokens=PAGES * PAGE_SIZE, heads=HEADS, head_dim=DIM,
            dtype=torch.float16,
        )  # fmt: skip

    def specs(self) -> list[tpb.PoolSpec]:
        return [
            pool_spec(
                "kv", role="anchor", kind="mha", dtype="float16", host_layout="page_first",
                page_size=PAGE_SIZE, num_layers=LAYERS, num_heads=HEADS, head_dim=DIM,
                k_buffers=self.kv.k_buffers(), v_buffers=self.kv.v_buffers(), host_ratio=1.0,
            )
        ]  # fmt: skip

    def page_bytes(self) -> torch.Tensor:
        """(PAGES, buffers, bytes per page per buffer) raw bytes of every page."""
        return torch.stack([t.view(torch.uint8).reshape(PAGES, -1) for t in (*self.kv.k, *self.kv.v)], dim=1)

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
def workers() -> Iterator[list[BigWorker]]:
    made: list[BigWorker] = []
    yield made
    for w in made:
        w.close()


def start(path: Path) -> Daemon:
    return start_daemon(
        "--l3", "file", "--l3-path", str(path), "--host-budget", "512MiB",
        "--set", "l3.write_policy=write_through_selective", "--set", f"server.max_batch_pages={CHUNK}",
    )  # fmt: skip


SLOT_BYTES = 69632  # the file backend's slot of a 64 KiB page: 512-byte header, 4 KiB aligned


def l3_slots(path: Path) -> int:
    """Slots the file backend's slab files have grown to (its progress, seen from outside)."""
    return sum(f.stat().st_size for f in path.glob("slab-*.dat")) // SLOT_BYTES


def test_sigkill_during_backup_loses_no_acknowledged_page(tmp_path: Path, workers: list[BigWorker]) -> None:
    l3 = tmp_path / "l3"
    keys = page_keys(list(range(PAGES * PAGE_SIZE)), PAGE_SIZE)
    writer = BigWorker()
    workers.append(writer)
    writer.fill_random(31)
    expected = writer.page_bytes()

    first = start(l3)
    try:
        with HiCacheClient(first.target, timeout_s=60.0) as client:
            session = client.attach(
                WorkerIdentity(writer.tag, generation=1, model_name=MODEL), writer.specs(), heartbeat=False
            )
            for lo in range(0, PAGES, CHUNK):
                put = session.put_pages(keys[lo : lo + CHUNK], [Transfer("kv", list(range(lo, lo + CHUNK)))])
                assert (put.ok, put.stored_pages) == (True, CHUNK)
            assert l3_slots(l3) == 0  # selective: nothing reaches L3 before it is asked
            acked = session.backup(keys[:ACKED], wait=True)
            assert (acked.queued_pages, acked.stored_pages) == (ACKED, ACKED)
            big = session.backup(keys[ACKED:])
            assert big.queued_pages == PAGES - ACKED
            # Kill as soon as the large backup is visibly under way.
            deadline = time.monotonic() + 30
            while (seen := l3_slots(l3)) <= ACKED and time.monotonic() < deadline:
                time.sleep(0.001)  # poll interval of a deadline-bounded wait
            assert seen > ACKED, "the large backup never started"
            first.process.send_signal(signal.SIGKILL)
            first.process.wait(timeout=30)
    finally:
        first.stop()  # already dead: removes its shm segments and work dir

    reader = BigWorker()
    workers.append(reader)
    reader.clobber()
    second = start(l3)
    try:
        with HiCacheClient(second.target, timeout_s=60.0) as client:
            session = client.attach(
                WorkerIdentity(reader.tag, generation=1, model_name=MODEL), reader.specs(), heartbeat=False
            )
            found = session.lookup(keys)
            assert found.l2_hit_pages == 0
            assert found.total_hit_pages >= ACKED, f"acknowledged pages lost (saw {seen} stored before kill)"
            served = 0
            for lo in range(0, PAGES, CHUNK):
                got = session.get_pages(
                    keys[lo : lo + CHUNK], [Transfer("kv", list(range(lo, lo + CHUNK)))], include_l3=True
                )
                served += got.hit_pages
                if got.hit_pages < CHUNK:
                    break
            assert served >= ACKED
            actual = reader.page_bytes()
            bad = [i for i in range(served) if not torch.equal(actual[i], expected[i])]
            assert not bad, f"pages served with wrong bytes: {bad[:10]}"
            # Pages past the served prefix were never written into the reader's memory.
            assert bool((actual[served:] == 0xFF).all())
    finally:
        second.stop()
