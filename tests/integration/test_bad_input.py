"""Issue 3 acceptance: bad input over the wire gets a precise status and changes nothing.

One worker session (this process, with its own shm pools) holds some host
pages and a retraction backup; each case sends one malformed request and
checks the status code, the message (it must name the offending value) and
that GetStats shows exactly the state from before the call.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Session, Transfer, WorkerIdentity
from hicached_client.v1 import types_pb2 as tpb

from tests.support.daemon import MAX_BATCH_PAGES, Daemon
from tests.support.kv import DEVICE_PAGES, WorkerPools, transfers, unique_tag
from tests.support.state import state

MODEL = "m-matrix"
GENERATION = 5
C = grpc.StatusCode


@dataclass
class Ctx:
    client: HiCacheClient
    session: Session
    pools: WorkerPools
    instance: str
    held: list[int]  # kv host pages this session owns
    free_kv_page: int  # a kv host page nobody owns
    freed: list[int]  # kv host pages this session allocated and freed again
    backup_id: str  # a 4-page retraction backup of this session
    host_pages: int  # kv host pool size

    def attach(self, specs: list[tpb.PoolSpec], *, lease_ms: int = 0, **identity: Any) -> Session:
        """Attach a second worker (a fresh instance unless ``instance_id`` is given)."""
        fields: dict[str, Any] = {"instance_id": unique_tag("matrix-x"), "generation": 1, "model_name": MODEL}
        fields.update(identity)
        return self.client.attach(WorkerIdentity(**fields), specs, lease_ms=lease_ms, heartbeat=False)

    def specs_with(self, mutate: Callable[[tpb.DeviceBuffer], None]) -> list[tpb.PoolSpec]:
        """The pool specs with ``mutate`` applied to the kv pool's first K buffer."""
        specs = self.pools.specs()
        mutate(specs[0].k_buffers[0])
        return specs


@pytest.fixture(scope="module")
def ctx(daemon: Daemon) -> Iterator[Ctx]:
    pools = WorkerPools.create(unique_tag("matrix"))
    instance = unique_tag("matrix")
    client = HiCacheClient(daemon.target, timeout_s=30.0)
    try:
        session = client.attach(
            WorkerIdentity(instance, generation=GENERATION, model_name=MODEL), pools.specs()
        )
        held = list(session.alloc("kv", 8).host_pages)
        backup = session.retract_backup("req-matrix", transfers([100, 101, 102, 103]), 16)
        assert backup.ok
        # Freed last: the allocator reuses freed pages first, so nothing may allocate after this.
        freed = held[-2:]
        assert session.free("kv", freed) == 2
        held = held[:-2]
        host_pages = session.info.pool("kv").total_pages
        free_page = host_pages - 1  # a dozen of its pages were allocated, from the bottom
        yield Ctx(client, session, pools, instance, held, free_page, freed, backup.backup_id, host_pages)
        session.detach()
    finally:
        client.close()
        pools.close()


def _fd(buf: tpb.DeviceBuffer) -> tpb.FdHandle:
    return buf.handle.fd


def _set_dtype(buf: tpb.DeviceBuffer) -> None:
    buf.dtype = tpb.DATA_TYPE_FLOAT32


def _set_heads(buf: tpb.DeviceBuffer) -> None:
    buf.shape[1] = 3


def _named_segment(buf: tpb.DeviceBuffer) -> None:
    """A buffer named by /dev/shm segment instead of handed over (refused since the fd handoff)."""
    fd = _fd(buf)
    buf.handle.shm.CopyFrom(
        tpb.ShmHandle(name=f"hct-named-{uuid.uuid4().hex[:8]}", offset=fd.offset, size=fd.size)
    )


def _misaligned(buf: tpb.DeviceBuffer) -> None:
    _fd(buf).offset += 3


def _past_end(buf: tpb.DeviceBuffer) -> None:
    _fd(buf).offset += 1 << 30


# (case id, expected code, regex the message must match, the bad call)
CASES: list[tuple[str, grpc.StatusCode, str, Callable[[Ctx], Any]]] = [
    ("unknown-session", C.NOT_FOUND, "session", lambda c: c.client.session("f" * 32).alloc("kv", 1)),
    (
        "stale-generation",
        C.FAILED_PRECONDITION,
        "generation",
        lambda c: c.attach(c.pools.specs(), instance_id=c.instance, generation=GENERATION - 1),
    ),
    ("unknown-pool-alloc", C.NOT_FOUND, "'nope'", lambda c: c.session.alloc("nope", 1)),
    (
        "ready-fence-not-supported",
        C.UNIMPLEMENTED,
        "fence",
        lambda c: c.session.write([Transfer("kv", [0])], allocate=True, ready=b"\x00" * 64),
    ),
    (
        "unknown-pool-write",
        C.NOT_FOUND,
        "'nope'",
        lambda c: c.session.write([Transfer("nope", [0])], allocate=True),
    ),
    (
        "device-page-out-of-range",
        C.OUT_OF_RANGE,
        f"{DEVICE_PAGES}",
        lambda c: c.session.write([Transfer("kv", [DEVICE_PAGES])], allocate=True),
    ),
    (
        "host-page-out-of-range",
        C.OUT_OF_RANGE,
        "host page",
        lambda c: c.session.load_wait([Transfer("kv", [0], host_pages=[c.host_pages + 5])]),
    ),
    (
        "free-page-at-int64-max",
        C.OUT_OF_RANGE,
        "host page 9223372036854775807",
        lambda c: c.session.free("kv", [2**63 - 1]),
    ),
    # Above 64 pages an ascending batch is checked by its ends alone: the same refusals.
    (
        "large-batch-device-page-out-of-range",
        C.OUT_OF_RANGE,
        f"device page {DEVICE_PAGES} out of range",
        lambda c: c.session.write(
            [Transfer("kv", list(range(DEVICE_PAGES - 99, DEVICE_PAGES + 1)))], allocate=True
        ),
    ),
    (
        "large-batch-negative-index",
        C.INVALID_ARGUMENT,
        "negative device page index -1",
        lambda c: c.session.write([Transfer("kv", list(range(-1, 99)))], allocate=True),
    ),
    (
        "large-batch-repeated-page",
        C.INVALID_ARGUMENT,
        "duplicate device page 50",
        lambda c: c.session.write([Transfer("kv", [*range(51), *range(50, 99)])], allocate=True),
    ),
    (
        "large-batch-host-page-out-of-range",
        C.OUT_OF_RANGE,
        "host page",
        lambda c: c.session.load_wait(
            [Transfer("kv", list(range(100)), host_pages=list(range(c.host_pages - 99, c.host_pages + 1)))]
        ),
    ),
    (
        "negative-index",
        C.INVALID_ARGUMENT,
        "negative .*-1",
        lambda c: c.session.write([Transfer("kv", [-1])], allocate=True),
    ),
    (
        "duplicate-device-pages",
        C.INVALID_ARGUMENT,
        "duplicate .*3",
        lambda c: c.session.write(transfers([3, 5, 3]), allocate=True),
    ),
    (
        "duplicate-host-pages",
        C.INVALID_ARGUMENT,
        "duplicate",
        lambda c: c.session.free("kv", [c.held[0], c.held[0]]),
    ),
    (
        "mismatched-lengths",
        C.INVALID_ARGUMENT,
        "2 device pages but 1 host pages",
        lambda c: c.session.load_wait([Transfer("kv", [1, 2], host_pages=[c.held[0]])]),
    ),
    (
        "pool-twice",
        C.INVALID_ARGUMENT,
        "twice",
        lambda c: c.session.write([Transfer("kv", [1]), Transfer("kv", [2])], allocate=True),
    ),
    (
        "free-unallocated-page",
        C.FAILED_PRECONDITION,
        "not allocated",
        lambda c: c.session.free("kv", [c.free_kv_page]),
    ),
    (
        "double-free",
        C.FAILED_PRECONDITION,
        "not allocated|double",
        lambda c: c.session.free("kv", c.freed),
    ),
    (
        "release-unallocated-page",
        C.FAILED_PRECONDITION,
        "not allocated|double",
        lambda c: c.session.release_transfers([Transfer("kv", [1], [c.free_kv_page], host_allocated=True)]),
    ),
    (
        "host-pages-missing",
        C.INVALID_ARGUMENT,
        "host_pages are required",
        lambda c: c.session.write([Transfer("kv", [1])]),
    ),
    (
        "oversized-batch",
        C.INVALID_ARGUMENT,
        f"max_batch_pages={MAX_BATCH_PAGES}",
        lambda c: c.session.write(transfers(range(MAX_BATCH_PAGES // 2 + 1)), allocate=True),
    ),
    (
        "oversized-alloc",
        C.INVALID_ARGUMENT,
        f"max_batch_pages={MAX_BATCH_PAGES}",
        lambda c: c.session.alloc("kv", MAX_BATCH_PAGES + 1),
    ),
    (
        "backup-without-anchor",
        C.INVALID_ARGUMENT,
        "anchor",
        lambda c: c.session.retract_backup("r", [Transfer("draft", [1])], 4),
    ),
    (
        "backup-too-many-tokens",
        C.INVALID_ARGUMENT,
        "num_tokens=9",
        lambda c: c.session.retract_backup("r", transfers([1, 2]), 9),
    ),
    (
        "backup-of-no-pages",
        C.INVALID_ARGUMENT,
        "at least one device page",
        lambda c: c.session.retract_backup("r", transfers([]), 0),
    ),
    (
        "backup-lease-too-long",
        C.INVALID_ARGUMENT,
        "sessions.max_lease_ms",
        lambda c: c.session.retract_backup("r", transfers([1]), 4, lease_ms=4_000_000_000),
    ),
    (
        "unknown-backup",
        C.NOT_FOUND,
        "b" * 32,
        lambda c: c.session.retract_restore_wait("b" * 32, transfers([1])),
    ),
    (
        "restore-wrong-length",
        C.INVALID_ARGUMENT,
        "4 pages",
        lambda c: c.session.retract_restore_wait(c.backup_id, transfers([200, 201, 202])),
    ),
    (
        "handle-wrong-dtype",
        C.INVALID_ARGUMENT,
        "dtype|size",
        lambda c: c.attach(c.specs_with(_set_dtype)),
    ),
    (
        "handle-wrong-shape",
        C.INVALID_ARGUMENT,
        "shape|size",
        lambda c: c.attach(c.specs_with(_set_heads)),
    ),
    (
        "handle-misaligned",
        C.INVALID_ARGUMENT,
        "align|offset",
        lambda c: c.attach(c.specs_with(_misaligned)),
    ),
    (
        "handle-past-segment-end",
        C.INVALID_ARGUMENT,
        "exceeds its allocation",
        lambda c: c.attach(c.specs_with(_past_end)),
    ),
    (
        "named-shm-segment",
        C.INVALID_ARGUMENT,
        "handle.shm .*refused",
        lambda c: c.attach(c.specs_with(_named_segment)),
    ),
    (
        "named-shm-segment-new-model",
        C.INVALID_ARGUMENT,
        "handle.shm .*refused",
        lambda c: c.attach(c.specs_with(_named_segment), model_name="m-matrix-never"),
    ),
    (
        "lease-out-of-bounds",
        C.INVALID_ARGUMENT,
        "lease_ms=100",
        lambda c: c.attach(c.pools.specs(), lease_ms=100),
    ),
    (
        "empty-instance-id",
        C.INVALID_ARGUMENT,
        "instance_id",
        lambda c: c.attach(c.pools.specs(), instance_id=""),
    ),
    (
        "host-budget-exceeded",
        C.RESOURCE_EXHAUSTED,
        "host.budget",
        lambda c: c.attach(c.pools.specs(host_ratio=300.0), model_name="m-matrix-huge"),
    ),
    (
        "duplicate-pool-name",
        C.ALREADY_EXISTS,
        "'kv'",
        lambda c: c.attach([c.pools.specs()[0], c.pools.specs()[0]]),
    ),
]


PARAMS = [pytest.param(code, pattern, call, id=name) for name, code, pattern, call in CASES]


@pytest.mark.parametrize(("code", "pattern", "call"), PARAMS)
def test_bad_input_gets_precise_status_and_changes_nothing(
    ctx: Ctx, admin: HiCacheClient, code: grpc.StatusCode, pattern: str, call: Callable[[Ctx], Any]
) -> None:
    before = state(admin)
    with pytest.raises(HiCacheError) as info:
        call(ctx)
    err = info.value
    assert err.code == code, f"expected {code.name}, got {err.code.name}: {err.message}"
    assert re.search(pattern, err.message), f"message {err.message!r} does not match {pattern!r}"
    assert state(admin) == before, "a failed call changed daemon state"


def test_matrix_session_still_works_after_every_bad_call(ctx: Ctx) -> None:
    """The good path after the matrix: the backup restores and the held pages free exactly once."""
    restored = ctx.session.retract_restore_wait(ctx.backup_id, transfers([200, 201, 202, 203]))
    assert {a.pool: a.pages for a in restored.acks} == {"kv": 4, "draft": 4}
    assert ctx.session.free("kv", ctx.held) == len(ctx.held)
    info = ctx.session.stats().session(ctx.session.session_id)
    assert info is not None and info.owned_pages == 0
