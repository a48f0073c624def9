"""Issue 10: the [limits] are stated in config and enforced before any work starts; each
refusal is a precise status naming the limit and its key, quotes at most a short prefix of
the client's value, and leaves GetStats exactly as it was. A real daemon at its default
limits over its real socket; byte-only sessions (no device memory) unless a test hands
buffers over."""

from __future__ import annotations

import os
import resource
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.internal.encoder import TagBytes, _VarintBytes
from hicached_client import (
    HiCacheClient,
    HiCacheError,
    PageBytes,
    Session,
    TokenChain,
    Transfer,
    WorkerIdentity,
    pool_spec,
)
from hicached_client.export import ShmKVPool
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

from tests.robustness.loop_support import PAGE_BYTES, FakeRedis, attach_bytes, byte_spec, raw_unary
from tests.robustness.state_support import device_pools, no_retry_client, specs
from tests.support.daemon import MAX_BATCH_PAGES, Daemon, start_daemon
from tests.support.state import fd_links, proc_bytes, state

C = grpc.StatusCode
MODEL = "m-limits"


@pytest.fixture(scope="module")
def admin(daemon: Daemon) -> Iterator[HiCacheClient]:
    with HiCacheClient(daemon.admin_target, timeout_s=30.0) as c:
        yield c


@pytest.fixture(scope="module")
def session(daemon: Daemon) -> Iterator[Session]:
    with HiCacheClient(daemon.target, timeout_s=60.0) as client:
        s = attach_bytes(client, MODEL, lease_ms=300_000)
        yield s
        s.detach()


def refused(call: object, code: grpc.StatusCode, key: str) -> HiCacheError:
    assert callable(call)
    with pytest.raises(HiCacheError) as err:
        call()
    assert err.value.code == code, err.value
    assert key in err.value.message, err.value.message
    assert len(err.value.message) < 400, len(err.value.message)
    return err.value


@pytest.mark.parametrize("rpc", ["Free", "ReleaseTransfers"])
def test_host_page_lists_past_max_batch_pages_are_refused_before_they_are_checked(
    daemon: Daemon, admin: HiCacheClient, session: Session, rpc: str
) -> None:
    """Fails before (a review of stop 47): server.max_batch_pages counted device pages only, so
    a Free (or a host-only ReleaseTransfers) of 8 M repeated page numbers (under 8 MiB) was
    converted and sorted on the event loop before its refusal: ~0.45 s a request, and eight
    sessions sending them in a loop held every other client's heartbeat for up to 5 s. Now
    the count is refused first, naming the key, and nothing changes."""
    over = [0] * (MAX_BATCH_PAGES + 1)  # repeated: the duplicate check would have sorted them
    before = state(admin)
    if rpc == "Free":
        refused(lambda: session.free("kv", over), C.INVALID_ARGUMENT, "server.max_batch_pages")
    else:
        given = [Transfer("kv", [], over, host_allocated=True)]
        refused(lambda: session.release_transfers(given), C.INVALID_ARGUMENT, "server.max_batch_pages")
    assert state(admin) == before


def test_get_bytes_of_one_key_3000_times_is_refused_before_building_the_answer(
    daemon: Daemon, admin: HiCacheClient, session: Session
) -> None:
    """Fails on main: the daemon built every page of the answer first (3,000 x 64 KiB here; the
    issue measured +922 MB RSS) and then failed on the message limit, naming no limit key."""
    key = uuid.uuid4().hex
    data = np.random.default_rng(1).integers(0, 256, PAGE_BYTES, dtype=np.uint8).tobytes()
    assert session.put_bytes([PageBytes(key, "kv", data)]).stored_pages == 1
    assert session.get_bytes([key]).pages[0].data == data
    before, rss = state(admin), proc_bytes(daemon.process.pid, "VmHWM")
    refused(lambda: session.get_bytes([key] * 3000), C.RESOURCE_EXHAUSTED, "limits.max_response_bytes")
    assert proc_bytes(daemon.process.pid, "VmHWM") - rss < 64 << 20  # the answer would be 188 MiB
    assert state(admin) == before


def test_a_token_chain_over_the_limit_is_refused_before_hashing(
    admin: HiCacheClient, session: Session
) -> None:
    """Fails on main: no limit; the chain was hashed (on the event loop) and answered."""
    before = state(admin)
    chain = TokenChain(np.zeros((1 << 20) + 16, dtype=np.int64))
    refused(lambda: session.lookup(chain), C.RESOURCE_EXHAUSTED, "limits.max_tokens_per_request")
    assert state(admin) == before


def test_too_many_keys_are_refused(admin: HiCacheClient, session: Session) -> None:
    """Fails on main: no limit on keys per request."""
    before = state(admin)
    keys = [f"{i:x}" for i in range((1 << 16) + 1)]
    refused(lambda: session.lookup(keys), C.RESOURCE_EXHAUSTED, "limits.max_keys_per_request")
    assert state(admin) == before


def test_a_partial_pages_key_counts_against_the_limit() -> None:
    """Before: a token chain was counted by its whole pages, so with ``include_partial_page`` it
    hashed one key over ``limits.max_keys_per_request``."""
    d = start_daemon("--set", "limits.max_keys_per_request=2")
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            s = attach_bytes(client, MODEL)
            page = 16  # byte_spec's page size
            assert len(s.lookup(TokenChain(list(range(2 * page + 1)))).keys) == 2
            refused(
                lambda: s.lookup(TokenChain(list(range(2 * page + 1)), include_partial_page=True)),
                C.RESOURCE_EXHAUSTED,
                "keys in this request: 3 exceeds limits.max_keys_per_request=2",
            )
            s.detach()
    finally:
        d.stop()


def test_a_long_key_is_refused_quoting_only_its_prefix(admin: HiCacheClient, session: Session) -> None:
    """Fails on main: keys had no length limit (the file backend failed on them later)."""
    before = state(admin)
    error = refused(lambda: session.lookup(["k" * 100_000]), C.INVALID_ARGUMENT, "limits.max_key_bytes")
    assert "100000 chars" in error.message
    page = PageBytes("p" * 100_000, "kv", bytes(PAGE_BYTES))
    refused(lambda: session.put_bytes([page]), C.INVALID_ARGUMENT, "limits.max_key_bytes")
    assert state(admin) == before


def test_a_key_is_measured_in_utf8_bytes_and_refused_by_its_position(
    admin: HiCacheClient, session: Session
) -> None:
    """A key of 256 two-byte characters is 512 bytes, at the default limit: accepted, though four
    bytes a character would be over. One more character, after five short keys, is refused
    naming keys[5]."""
    limit = 512  # limits.max_key_bytes, default
    before = state(admin)
    assert session.lookup(["a", "\u00e9" * (limit // 2)]).total_hit_pages == 0
    refused(lambda: session.lookup(["a"] * 5 + ["\u00e9" * (limit // 2 + 1)]), C.INVALID_ARGUMENT, "keys[5]")
    assert state(admin) == before


def test_long_identity_strings_are_refused(daemon: Daemon, admin: HiCacheClient, session: Session) -> None:
    """Fails on main: a 1 MiB instance id was accepted (70 of them made GetStats exceed the
    message limit), and a 100 KB op_id was echoed whole into the error."""
    before = state(admin)
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        refused(
            lambda: client.attach(WorkerIdentity("i" * (1 << 20), 1, MODEL), [byte_spec()], heartbeat=False),
            C.INVALID_ARGUMENT,
            "limits.max_identity_bytes",
        )
    refused(
        lambda: session.alloc("kv", 1, op_id="o" * 100_000), C.INVALID_ARGUMENT, "limits.max_identity_bytes"
    )
    # A pool named inside a request's transfers or pages (before: NOT_FOUND quoting 1 KB of it).
    long_pool = "p" * 100_000
    err = refused(
        lambda: session.release_transfers([Transfer(long_pool, [], [0])]),
        C.INVALID_ARGUMENT,
        "limits.max_identity_bytes",
    )
    assert "transfers[0].pool" in err.message, err.message
    err = refused(
        lambda: session.put_bytes([PageBytes("k", long_pool, b"x")]),
        C.INVALID_ARGUMENT,
        "limits.max_identity_bytes",
    )
    assert "pages[0].pool" in err.message, err.message
    assert state(admin) == before


def test_sessions_per_peer_are_limited(daemon: Daemon, admin: HiCacheClient) -> None:
    """Fails on main: nothing capped sessions per peer (3,000 attaches added 380 MB). Byte-only
    clients on the socket are one peer: the 257th live session is refused."""
    held: list[Session] = []
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        try:
            live = len(admin.get_stats().sessions)  # the module's own session counts too
            # A lease as long as the module session's: 255 attaches without heartbeats outlasted
            # the 1.5 s default lease on a loaded machine, and the first sessions expired.
            for _ in range(256 - live):
                held.append(attach_bytes(client, MODEL, lease_ms=300_000))
            before = state(admin)
            refused(lambda: attach_bytes(client, MODEL), C.RESOURCE_EXHAUSTED, "limits.max_sessions_per_peer")
            assert state(admin) == before
            held.pop().detach()
            held.append(attach_bytes(client, MODEL, lease_ms=300_000))  # a detach makes room again
        finally:
            for s in held:
                s.detach()


def test_buffers_per_attach_are_limited(daemon: Daemon, admin: HiCacheClient) -> None:
    """Fails on main: an attach could hand over any number of buffers (each one mapped)."""
    layers = 257  # K and V: 514 buffers, over limits.max_buffers_per_attach = 512
    with ShmKVPool(f"hcl-{uuid.uuid4().hex[:8]}", num_layers=layers, tokens=16, heads=1, head_dim=8,
                   dtype=torch.float16) as kv, HiCacheClient(daemon.target, timeout_s=30.0) as client:  # fmt: skip
        spec = pool_spec(
            "kv", role="anchor", kind="mha", dtype="float16", page_size=16, num_layers=layers, num_heads=1,
            head_dim=8, k_buffers=kv.k_buffers(), v_buffers=kv.v_buffers(),
        )  # fmt: skip
        before = state(admin)
        refused(
            lambda: client.attach(WorkerIdentity("wide", 1, "m-wide"), [spec], heartbeat=False),
            C.RESOURCE_EXHAUSTED,
            "limits.max_buffers_per_attach",
        )
        assert state(admin) == before


def _byte_sidecar(name: str) -> tpb.PoolSpec:
    return pool_spec(
        name, role="sidecar", kind="mha", dtype="bfloat16", page_size=16, num_layers=2, num_heads=1,
        head_dim=8, host_layout="layer_first", k_buffers=(), v_buffers=(), host_bytes=1 << 16,
    )  # fmt: skip


def test_pools_per_attach_are_limited(daemon: Daemon, admin: HiCacheClient) -> None:
    """Fails on main: byte-only pools have no buffers to count, and each costs the daemon a host
    segment, its descriptor and four metric series (a 2,000-pool attach held ~2,000 descriptors,
    ~20 of them ran the daemon out of descriptors for every other client)."""
    sidecars = [_byte_sidecar(f"side{i}") for i in range(32)]
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        before = state(admin)
        refused(
            lambda: client.attach(
                WorkerIdentity("many", 1, "m-many"), [byte_spec(), *sidecars], heartbeat=False
            ),
            C.RESOURCE_EXHAUSTED,
            "limits.max_pools_per_attach=32",
        )
        assert state(admin) == before
        client.attach(
            WorkerIdentity("many", 1, "m-many"), [byte_spec(), *sidecars[:31]], heartbeat=False
        ).detach()


def test_layers_per_pool_are_limited(daemon: Daemon, admin: HiCacheClient) -> None:
    """Fails on main: a byte-only pool of 8 M layers (16 MB of host pages) built per-layer
    bookkeeping at attach: +2.4 GiB peak RSS and 7 s during which another client's GetStats
    waited."""
    spec = pool_spec(
        "kv", role="anchor", kind="mha", dtype="bfloat16", page_size=1, num_layers=4097, num_heads=1,
        head_dim=1, host_layout="layer_first", k_buffers=(), v_buffers=(), host_bytes=64 * 4097 * 4,
    )  # fmt: skip
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        before = state(admin)
        refused(
            lambda: client.attach(WorkerIdentity("deep", 1, "m-deep"), [spec], heartbeat=False),
            C.RESOURCE_EXHAUSTED,
            "limits.max_layers_per_pool=4096",
        )
        assert state(admin) == before


@pytest.mark.parametrize("method", ["HiCacheService/Lookup", "HiCacheService/Load", "AdminService/Drain"])
def test_undecodable_bytes_are_invalid_argument(daemon: Daemon, admin: HiCacheClient, method: str) -> None:
    """Fails on main: grpc answered UNKNOWN ("Unexpected <class 'DecodeError'>") with an
    error-level traceback in the daemon's log."""
    before = state(admin)
    error = raw_unary(daemon.target, f"/hicached.v1.{method}", b"\xff\xff\xff\xff")
    assert error.code() == C.INVALID_ARGUMENT, error
    assert "undecodable" in (error.details() or "")
    assert state(admin) == before
    assert "DecodeError" not in daemon.log


def test_out_of_descriptors_is_resource_exhausted_and_changes_nothing() -> None:
    """Fails on main: under a low RLIMIT_NOFILE a wide attach failed INVALID_ARGUMENT ("more than
    64 fds in one handoff", "cannot be mapped read-write") or INTERNAL (OSError EMFILE). The
    daemon's limit is lowered to what it holds plus 1..8 descriptors; every attach that does
    not fit is RESOURCE_EXHAUSTED, leaves GetStats as it was, and leaks no descriptor."""
    d = start_daemon()
    pid = d.process.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    try:
        with (
            device_pools() as dev,
            no_retry_client(d.target) as client,
            HiCacheClient(d.admin_target, timeout_s=30.0) as admin,
        ):
            before = state(admin)
            held = len(os.listdir(f"/proc/{pid}/fd"))  # both clients connected: the baseline
            codes = []
            for spare in range(1, 9):
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (held + spare, hard))
                try:
                    attached = client.attach(
                        WorkerIdentity(f"fds-{spare}", 1, "m-fds"), specs(dev), heartbeat=False
                    )
                except HiCacheError as exc:
                    codes.append(exc.code)
                    assert exc.code == C.RESOURCE_EXHAUSTED, exc
                    assert "EMFILE" in exc.message, exc.message
                else:
                    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
                    attached.detach()
                    # Its pool group stays (a cache outlives its sessions): what a later
                    # refused attach must leave as it was. (Mappings hold no descriptor, so
                    # a few spare ones may be enough.)
                    before = state(admin)
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
                assert state(admin) == before
            assert C.RESOURCE_EXHAUSTED in codes
            fds = fd_links(pid)
            assert len(fds) <= held + 2, fds
            client.attach(WorkerIdentity("fds-after", 1, "m-fds"), specs(dev), heartbeat=False).detach()
    finally:
        d.stop()


def test_prefetches_running_per_session_are_limited() -> None:
    """Fails before limits.max_prefetches_per_session: a session could queue any number of
    prefetches, each holding its plan of up to limits.max_keys_per_request keys on the index's
    I/O threads, which take the queued jobs in turn (every bystander's prefetch waited behind
    them). L3 is a fake Redis that holds every key and never answers a read, so the daemon's one
    I/O thread stays inside the first prefetch and the second stays queued: both are running.
    A third is refused naming the key and changes nothing; another session may still prefetch;
    once one is cancelled, the session may start one again."""
    fake = FakeRedis(present=True)
    d = start_daemon(
        *fake.daemon_args(),
        "--set", "l3.io_workers=1",
        "--set", "limits.max_prefetches_per_session=2",
    )  # fmt: skip
    try:
        with (
            HiCacheClient(d.target, timeout_s=30.0) as client,
            HiCacheClient(d.admin_target, timeout_s=30.0) as admin,
        ):
            session, bystander = attach_bytes(client, "m-pf"), attach_bytes(client, "m-pf")
            fake.hang(only=frozenset({b"GETRANGE"}))
            first = session.prefetch(["a0", "a1"])
            fake.wait_unanswered(1, timeout_s=30)  # the I/O thread is inside the first one
            second = session.prefetch(["b0"])
            assert (first.planned_pages, second.planned_pages) == (2, 1)
            before = state(admin)
            refused(
                lambda: session.prefetch(["c0"]), C.RESOURCE_EXHAUSTED, "limits.max_prefetches_per_session"
            )
            assert state(admin) == before
            assert bystander.prefetch(["d0"]).planned_pages == 1  # the limit is per session
            assert session.cancel_prefetch(second.prefetch_id) == 0  # queued: cancelled at once
            assert session.prefetch(["e0"]).planned_pages == 1  # room again
            refused(
                lambda: session.prefetch(["f0"]), C.RESOURCE_EXHAUSTED, "limits.max_prefetches_per_session"
            )
            fake.close()  # the blocked read fails, so the sessions can end
            session.detach()
            bystander.detach()
    finally:
        fake.close()
        d.stop()


def test_the_keys_a_peers_running_prefetches_plan_are_bounded() -> None:
    """Fails before limits.max_prefetch_keys_per_peer (a review of stop 47): each running
    prefetch keeps its plan, every key it will read (~150 bytes a key), and only the count per
    session was bounded, so one peer's 256 sessions could hold 4,096 plans of 65,536 keys (a
    review: +505 MiB from 58, growing). Here one peer's two sessions plan 6 + 3 keys against a
    bound of 10: a third plan of 2 is refused naming the key and changes nothing, one of 1
    fits, and a cancelled plan gives its keys back. A peer holding none is always admitted."""
    fake = FakeRedis(present=True)
    d = start_daemon(
        *fake.daemon_args(),
        "--set", "l3.io_workers=1",
        "--set", "limits.max_prefetch_keys_per_peer=10",
    )  # fmt: skip
    try:
        with (
            HiCacheClient(d.target, timeout_s=30.0) as client,
            HiCacheClient(d.admin_target, timeout_s=30.0) as admin,
        ):
            one, two = attach_bytes(client, "m-pfk"), attach_bytes(client, "m-pfk")  # one peer
            fake.hang(only=frozenset({b"GETRANGE"}))
            first = one.prefetch([f"a{i}" for i in range(6)])
            fake.wait_unanswered(1, timeout_s=30)  # the I/O thread is inside the first one
            second = two.prefetch([f"b{i}" for i in range(3)])
            assert (first.planned_pages, second.planned_pages) == (6, 3)
            before = state(admin)
            refused(
                lambda: two.prefetch(["c0", "c1"]), C.RESOURCE_EXHAUSTED, "limits.max_prefetch_keys_per_peer"
            )
            assert state(admin) == before
            assert one.prefetch(["d0"]).planned_pages == 1  # 10 of 10
            refused(lambda: one.prefetch(["e0"]), C.RESOURCE_EXHAUSTED, "limits.max_prefetch_keys_per_peer")
            assert two.cancel_prefetch(second.prefetch_id) == 0  # queued: cancelled at once
            assert two.prefetch(["f0", "f1", "f2"]).planned_pages == 3  # its keys are back
            fake.close()  # the blocked read fails, so the sessions can end
            one.detach()
            two.detach()
    finally:
        fake.close()
        d.stop()


# One request of a million empty transfers, as raw bytes signed with the attacker's own secret.
SHORT_LEASE_MS = 1500
TRANSFERS = 1_000_000
SERVICE = "/hicached.v1.HiCacheService/"


def _field(number: int, body: bytes) -> bytes:
    return TagBytes(number, 2) + _VarintBytes(len(body)) + body


def _empty_transfers(number: int) -> bytes:
    """``TRANSFERS`` empty messages in repeated field ``number``: two bytes each on the wire."""
    return (TagBytes(number, 2) + _VarintBytes(0)) * TRANSFERS


def _payloads(session_id: str) -> dict[str, bytes]:
    def head(request: type) -> bytes:
        return bytes(request(session_id=session_id, op_id="op-many").SerializeToString())

    batch_field = tpb.TransferBatch.DESCRIPTOR.fields_by_name["transfers"].number
    batch = _empty_transfers(batch_field)
    keys = tpb.KeySource(keys=tpb.PageKeys(keys=["k"])).SerializeToString()  # field 3 of both
    return {
        "Write": head(pb.WriteRequest) + _field(3, batch),
        "GetPages": head(pb.GetPagesRequest) + _field(3, keys) + _field(4, batch),
        "Publish": head(pb.PublishRequest) + _field(3, keys) + _empty_transfers(4),
        "ReleaseTransfers": head(pb.ReleaseTransfersRequest) + _empty_transfers(3),
    }


def test_a_million_transfers_are_refused_before_conversion_while_others_keep_answering(
    daemon: Daemon, admin: HiCacheClient
) -> None:
    """One request of a million empty transfers (2 MiB on the wire) is refused before its
    transfers are converted on the event loop, and another session's heartbeats keep answering
    within its lease. Fails on the code before the bound: each call held the loop ~4 s converting
    its transfers (~4 us each; then NOT_FOUND for the unknown pool), and the victim's 1.5 s lease
    ran out behind it (its heartbeat NOT_FOUND)."""
    with HiCacheClient(daemon.target, timeout_s=10.0) as client:
        victim = attach_bytes(client, "m-victim", lease_ms=SHORT_LEASE_MS)
        attacker = attach_bytes(client, "m-attacker")
        before = state(admin)
        payloads = _payloads(attacker.session_id)
        assert all(len(p) > 2 * TRANSFERS for p in payloads.values())
        errors: dict[str, grpc.RpcError] = {}

        def attack() -> None:
            for method, payload in payloads.items():
                errors[method] = _signed(daemon.target, attacker, method, payload)

        thread = threading.Thread(target=attack)
        latencies: list[float] = []
        thread.start()
        try:
            while thread.is_alive():
                start = time.perf_counter()
                victim.heartbeat()  # NOT_FOUND if its lease ran out behind a stalled loop
                latencies.append(time.perf_counter() - start)
        finally:
            thread.join(timeout=120)
        assert sorted(errors) == sorted(payloads), errors
        for method, exc in errors.items():
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, (method, exc.code(), exc.details())
            assert f"{TRANSFERS} transfers in one request" in (exc.details() or ""), (method, exc.details())
            assert "limits.max_pools_per_attach=" in (exc.details() or ""), (method, exc.details())
        assert latencies and max(latencies) < SHORT_LEASE_MS / 1000, max(latencies, default=None)
        assert state(admin) == before
        victim.heartbeat()
        attacker.heartbeat()
        attacker.detach()
        victim.detach()


def _signed(target: str, session: Session, method: str, payload: bytes) -> grpc.RpcError:
    """Send ``payload`` as the raw request bytes of ``method``, signed with ``session``'s
    secret; the error it gets."""
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
        call = channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            call(payload, timeout=60, metadata=[("x-hicached-session-secret", session.info.session_secret)])
        except grpc.RpcError as exc:
            return exc
    raise AssertionError(f"{method} accepted {len(payload)} bytes")


def test_a_request_over_the_parse_limit_is_refused_before_parsing(
    admin: HiCacheClient, session: Session
) -> None:
    """Before: any request up to server.max_message_bytes (64 MiB) was parsed on the event loop
    first; a Lookup of 65,536 keys of 140 bytes (9.3 MiB, within the key limits) was answered."""
    before = state(admin)
    keys = [f"{i:0140x}" for i in range(1 << 16)]
    err = refused(lambda: session.lookup(keys), C.RESOURCE_EXHAUSTED, "limits.max_request_bytes=8388608")
    assert "Lookup request of" in err.message, err.message
    assert state(admin) == before


def test_a_put_bytes_of_many_tiny_pages_is_refused_before_it_is_parsed(
    daemon: Daemon, admin: HiCacheClient, session: Session
) -> None:
    """Before: the 10 million empty pages (20 MiB on the wire, under server.max_message_bytes)
    were parsed first (~0.45 s of the event loop, ~700 MiB of the daemon's memory) and only
    then refused by their count. Now their count is taken from the wire, without parsing."""
    before, rss = state(admin), proc_bytes(daemon.process.pid, "VmHWM")
    head = pb.PutBytesRequest(session_id=session.session_id, op_id="op-tiny-pages").SerializeToString()
    pages = pb.PutBytesRequest.DESCRIPTOR.fields_by_name["pages"].number
    err = _signed(
        daemon.target, session, "PutBytes", head + (TagBytes(pages, 2) + _VarintBytes(0)) * 10_000_000
    )
    grown = proc_bytes(daemon.process.pid, "VmHWM") - rss
    assert grown < 128 << 20, f"the daemon's peak RSS grew {grown >> 20} MiB"
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
    details = err.details() or ""
    assert "limits.max_keys_per_request=65536 (counted before parsing)" in details, details
    assert state(admin) == before
