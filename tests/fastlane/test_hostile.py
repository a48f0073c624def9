"""Hostile records on the lane: each is answered with a precise status in its completion,
changes nothing the daemon reports, and leaves the lane working."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Transfer
from hicached_client import lane_wire as w

from tests.fastlane.conftest import Worker
from tests.support.state import state

Desc = tuple[bytes, int, int, int, int]  # pool, ndevice, nhost, tflags, reserved


def record(
    *,
    opcode: int = w.Opcode.WRITE,
    flags: int = w.FLAG_ALLOCATE,
    transfers: list[Desc] | None = None,
    pages: list[int] | None = None,
    count: int | None = None,
    magic: int = w.REQUEST_MAGIC,
    version: int = w.VERSION,
    op_id: bytes = b"",
    seq_delta: int = 0,
    keys: bytes = b"",
) -> Callable[[memoryview, int, int], None]:
    descs = transfers if transfers is not None else [(b"kv", 1, 0, 0, 0)]
    body = (
        b"".join(w.TRANSFER.pack(*d) for d in descs)
        + struct.pack(f"<{len(pages if pages is not None else [1])}q", *(pages if pages is not None else [1]))
        + keys
    )

    def fill(view: memoryview, offset: int, seq: int) -> None:
        n = len(descs) if count is None else count
        w.REQUEST.pack_into(
            view,
            offset,
            magic,
            version,
            opcode,
            flags,
            n,
            seq + seq_delta,
            op_id or os.urandom(8).hex().encode(),
        )
        view[offset + w.REQUEST.size : offset + w.REQUEST.size + len(body)] = body

    return fill


def key_section(*raw: bytes, count: int | None = None, lengths: list[int] | None = None) -> bytes:
    """A GetPages/PutPages key section: count, u16 lengths, bytes (each may lie)."""
    sizes = lengths if lengths is not None else [len(r) for r in raw]
    n = len(raw) if count is None else count
    return struct.pack(f"<I{len(sizes)}H", n, *sizes) + b"".join(raw)


def keyed(keys: bytes, **kw: object) -> Callable[[memoryview, int, int], None]:
    both = [(b"kv", 1, 0, 0, 0), (b"draft", 1, 0, 0, 0)]
    return record(opcode=w.Opcode.GET_PAGES, flags=0, transfers=both, pages=[1, 1], keys=keys, **kw)  # type: ignore[arg-type]


def garbage(view: memoryview, offset: int, seq: int) -> None:
    view[offset : offset + 4096] = os.urandom(4096)


CASES: list[tuple[str, Callable[[memoryview, int, int], None], grpc.StatusCode, str]] = [
    ("garbage bytes", garbage, grpc.StatusCode.INVALID_ARGUMENT, "not a lane request record"),
    ("other version", record(version=9), grpc.StatusCode.INVALID_ARGUMENT, "version 9"),
    ("unknown opcode", record(opcode=77), grpc.StatusCode.UNIMPLEMENTED, "opcode 77"),
    ("unknown flags", record(flags=0x80), grpc.StatusCode.INVALID_ARGUMENT, "unknown flag bits 0x80"),
    ("too many transfers", record(count=1_000_000), grpc.StatusCode.INVALID_ARGUMENT, "1000000 transfers"),
    ("oversized page count", record(transfers=[(b"kv", 2**31, 0, 0, 0)]), grpc.StatusCode.INVALID_ARGUMENT,
     "more than fit in one lane record"),
    ("host pages without flag", record(transfers=[(b"kv", 1, 1, 0, 0)], pages=[1, 2]),
     grpc.StatusCode.INVALID_ARGUMENT, "without the has-host flag"),
    ("reserved field set", record(transfers=[(b"kv", 1, 0, 0, 7)]), grpc.StatusCode.INVALID_ARGUMENT, "reserved"),
    ("pool name not UTF-8", record(transfers=[(b"\xff\xfe", 1, 0, 0, 0)]), grpc.StatusCode.INVALID_ARGUMENT,
     "not UTF-8"),
    ("unknown pool", record(transfers=[(b"nope", 1, 0, 0, 0)]), grpc.StatusCode.NOT_FOUND, "unknown pool 'nope'"),
    ("negative page", record(pages=[-5]), grpc.StatusCode.INVALID_ARGUMENT, "negative device page index -5"),
    ("page out of range", record(pages=[1 << 40]), grpc.StatusCode.OUT_OF_RANGE, "out of range"),
    ("duplicate pages", record(transfers=[(b"kv", 2, 0, 0, 0)], pages=[3, 3]), grpc.StatusCode.INVALID_ARGUMENT,
     "duplicate device page 3"),
    ("load of host pages it does not own", record(opcode=w.Opcode.LOAD, flags=0,
     transfers=[(b"kv", 1, 1, w.T_HAS_HOST, 0)], pages=[1, 0]), grpc.StatusCode.FAILED_PRECONDITION, "is not allocated"),
    ("sequence mismatch", record(seq_delta=5), grpc.StatusCode.INVALID_ARGUMENT, "does not match"),
    ("op_id not printable", record(op_id=b"\x01\x02"), grpc.StatusCode.INVALID_ARGUMENT, "op_id"),
    ("key count beyond the slot", keyed(key_section(count=2**31)), grpc.StatusCode.INVALID_ARGUMENT,
     "2147483648 keys, more than fit"),
    ("key bytes beyond the slot", keyed(key_section(count=20, lengths=[65535] * 20)),
     grpc.StatusCode.INVALID_ARGUMENT, "bytes of keys, more than fit"),
    # Over limits.max_keys_per_request (65,536): refused on the count, before any length is
    # read (these lengths would claim 4 GiB of keys).
    ("keys over the limit", keyed(key_section(count=65537, lengths=[65535] * 65537)),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "65537 exceeds limits.max_keys_per_request"),
    ("key not UTF-8", keyed(key_section(b"\xff\xfe")), grpc.StatusCode.INVALID_ARGUMENT, "keys[0] is not UTF-8"),
    ("key over limits.max_key_bytes", keyed(key_section(b"k" * 600)), grpc.StatusCode.INVALID_ARGUMENT,
     "limits.max_key_bytes"),
    ("fewer keys than pages", keyed(key_section()), grpc.StatusCode.INVALID_ARGUMENT, "1 device pages for 0 keys"),
    ("include_l3 on a put", record(opcode=w.Opcode.PUT_PAGES, flags=w.FLAG_INCLUDE_L3, keys=key_section(b"a")),
     grpc.StatusCode.INVALID_ARGUMENT, "flag"),
    ("a lookup with transfers", record(opcode=w.Opcode.LOOKUP, flags=0, keys=key_section(b"a")),
     grpc.StatusCode.INVALID_ARGUMENT, "keys only, no transfers"),
    ("a flag on a lookup", record(opcode=w.Opcode.LOOKUP, flags=w.FLAG_INCLUDE_L3, transfers=[], pages=[],
     keys=key_section(b"a")), grpc.StatusCode.INVALID_ARGUMENT, "mean nothing for LOOKUP"),
    ("lookup key not UTF-8", record(opcode=w.Opcode.LOOKUP, flags=0, transfers=[], pages=[],
     keys=key_section(b"\xff")), grpc.StatusCode.INVALID_ARGUMENT, "keys[0] is not UTF-8"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "fill", "code", "words"), CASES, ids=[c[0] for c in CASES])
def test_hostile_record_gets_a_precise_status_and_changes_nothing(
    worker: Worker, admin: HiCacheClient, what: str, fill: Callable[[memoryview, int, int], None],
    code: grpc.StatusCode, words: str,
) -> None:  # fmt: skip
    lane = worker.lane
    before = state(admin)
    seq = lane.submit_raw(fill)
    done = lane.raw_completion(seq, timeout_s=30)
    assert (done.status, done.ok) == (code.value[0], False), f"{what}: {done}"
    assert words in done.message, f"{what}: {done.message!r}"
    assert len(done.message.encode()) <= w.MESSAGE_BYTES
    assert state(admin) == before, f"{what} changed the daemon's state"
    # The lane still serves its session.
    ok = lane.write([Transfer("kv", [1])], allocate=True)
    assert ok.ok
    lane.release_transfers(list(ok.transfers))


def test_load_of_foreign_pages_is_refused_like_grpc(worker: Worker) -> None:
    """The lane's answer to a load of host pages the session does not own equals gRPC's."""
    bad = [Transfer("kv", [1], [0])]
    with pytest.raises(HiCacheError) as lane_err:
        worker.lane.load(bad)
    with pytest.raises(HiCacheError) as grpc_err:
        worker.session.load_wait(bad)
    assert (lane_err.value.code, lane_err.value.message) == (grpc_err.value.code, grpc_err.value.message)


def test_a_write_whose_answer_might_not_fit_is_refused_before_it_allocates(
    worker: Worker, admin: HiCacheClient
) -> None:
    """Without the up-front bound, an allocated answer too large for the completion slot would
    leave pages allocated that the client never learns of."""
    before = state(admin)
    with pytest.raises(HiCacheError) as err:
        worker.lane.write([Transfer("kv", list(range(40_000)))], allocate=True)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "split the batch" in err.value.message
    assert state(admin) == before


@pytest.mark.parametrize(
    "bad",
    [[Transfer("k\x1b[2Jv", [1])], [Transfer(f"p{i}", [1]) for i in range(40)]],
    ids=["control characters in a pool name", "more transfers than pools"],
)
def test_the_lane_checks_transfers_as_grpc_does(
    worker: Worker, admin: HiCacheClient, bad: list[Transfer]
) -> None:
    """Fails before (a review of stop 46): gRPC refuses a pool name that is not printable and
    more transfers than limits.max_pools_per_attach when it converts a request
    (INVALID_ARGUMENT); the lane skipped both checks and answered NOT_FOUND."""
    before = state(admin)
    with pytest.raises(HiCacheError) as lane_err:
        worker.lane.write(bad, allocate=True)
    with pytest.raises(HiCacheError) as grpc_err:
        worker.session.write(bad, allocate=True)
    assert lane_err.value.code == grpc.StatusCode.INVALID_ARGUMENT, lane_err.value
    assert (lane_err.value.code, lane_err.value.message) == (grpc_err.value.code, grpc_err.value.message)
    assert state(admin) == before


def test_a_keyed_op_checks_its_keys_before_its_transfers_as_grpc_does(worker: Worker) -> None:
    """Fails before (a review of the fix above): the lane checked the transfers first, so a
    PutPages with an over-long key and a non-printable pool name got the pool's message over
    the lane and the key's over gRPC."""
    keys, bad = ["k" * 600], [Transfer("kv\x07", [1])]
    with pytest.raises(HiCacheError) as lane_err:
        worker.lane.put_pages(keys, bad)
    with pytest.raises(HiCacheError) as grpc_err:
        worker.session.put_pages(keys, bad)
    assert "limits.max_key_bytes" in grpc_err.value.message, grpc_err.value
    assert (lane_err.value.code, lane_err.value.message) == (grpc_err.value.code, grpc_err.value.message)
