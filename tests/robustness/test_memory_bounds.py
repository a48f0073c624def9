"""What one client can make the daemon hold (docs/limits.md): pool groups, the answers it
leaves unread, the calls it queues on the hash lane, the metric series it names. Each test
runs a real daemon and fails on the code before its bound."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hicached_client import HiCacheClient, HiCacheError, PageBytes, TokenChain, WorkerIdentity, pool_spec
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

from hicached.core.footprint import bookkeeping_bytes, entry_bytes
from hicached.page_keys import page_keys
from tests.robustness.loop_support import PAGE, attach_bytes
from tests.support.daemon import MAX_BATCH_PAGES, Daemon, start_daemon
from tests.support.state import poll, proc_bytes

MIB = 1 << 20

LOOKUP = "/hicached.v1.HiCacheService/Lookup"


def test_a_lookup_of_given_keys_does_not_send_them_back(daemon: Daemon) -> None:
    """Before, Lookup echoed every given key: up to 32 MiB per answer, built and serialized on
    the event loop (a bystander waited ~0.3 s) and held while a client that stopped reading
    let it sit unsent (~160 MiB per call). Keys derived from tokens still come back."""
    with HiCacheClient(daemon.target) as client:
        session = attach_bytes(client, "m-echo", lease_ms=60_000)
        keys = [f"{i:064x}" for i in range(4096)]
        request = pb.LookupRequest(
            session_id=session.session_id, keys=tpb.KeySource(keys=tpb.PageKeys(keys=keys))
        )
        secret = (("x-hicached-session-secret", session.info.session_secret),)
        with grpc.insecure_channel(daemon.target) as channel:
            call = channel.unary_unary(LOOKUP, request_serializer=None, response_deserializer=None)
            raw = call(request.SerializeToString(), metadata=secret, timeout=30)
        answer = pb.LookupResponse.FromString(raw)
        assert list(answer.keys) == [] and len(raw) < 64
        assert session.lookup(keys).keys == tuple(keys)  # the client names them from its request
        tokens = list(range(4 * PAGE))
        assert session.lookup(TokenChain(tokens)).keys == tuple(page_keys(tokens, PAGE))
        session.detach()


def test_pool_groups_are_bounded_in_number_idle_ones_retired_first() -> None:
    """Before, every Attach under a new model or layout left a pool group behind when it
    detached: a byte-only client with tiny pools made ~9,400 of them in 80 s (4 KB of the host
    budget each, but a descriptor and ~7 memory maps each), until the daemon ran out of memory
    maps and failed everyone, or died. Now host.max_groups bounds them: a new group retires the
    least recently used idle one, and is refused only when every group has sessions."""
    d = start_daemon("--set", "host.max_groups=2")
    try:
        with HiCacheClient(d.target) as client, HiCacheClient(d.admin_target) as admin:
            for i in range(6):  # attach and detach under a new model: one group each
                attach_bytes(client, f"m-groups-{i}", lease_ms=60_000).detach()
                assert len(admin.get_stats().groups) <= 2
            kept = [attach_bytes(client, f"m-busy-{i}", lease_ms=60_000) for i in range(2)]
            before = admin.get_stats()
            assert sorted(g.model_name for g in before.groups) == ["m-busy-0", "m-busy-1"]
            with pytest.raises(HiCacheError) as refused:
                attach_bytes(client, "m-one-too-many", lease_ms=60_000)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "host.max_groups=2" in refused.value.message
            after = admin.get_stats()
            assert [g.group for g in after.groups] == [g.group for g in before.groups]
            for session in kept:
                session.detach()
    finally:
        d.stop()


def _channel(target: str) -> grpc.Channel:
    # Its own connection: channels to one target otherwise share a subchannel.
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def _connects(channel: grpc.Channel, timeout_s: float) -> bool:
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        return False
    return True


def test_a_listener_accepts_at_most_max_connections() -> None:
    """Before, connections that never made a call had no bound: one process held 19,973 of them,
    the daemon ran out of descriptors, and new workers could not attach."""
    d = start_daemon("--set", "server.max_connections=4")
    held: list[grpc.Channel] = []
    try:
        held = [_channel(d.target) for _ in range(4)]
        assert all(_connects(ch, 10.0) for ch in held)
        extra = _channel(d.target)
        held.append(extra)
        assert not _connects(extra, 2.0)  # refused while 4 are open
        with HiCacheClient(d.admin_target) as admin:  # another listener: its own count
            assert admin.get_stats().version
        held.pop(0).close()
        assert _connects(extra, 10.0)
    finally:
        for ch in held:
            ch.close()
        d.stop()


def test_connections_that_send_nothing_give_their_slots_back() -> None:
    """Before, a connection that never sent its HTTP/2 preface held its slot of
    ``server.max_connections`` for about a minute (grpc's handshake deadline): a stranger that
    reconnected once a minute kept every other client of the listener out (a reviewer held all
    1,024 TCP slots with raw connects). Now the slot is given back after 5 s."""
    d = start_daemon("--set", "server.max_connections=4")
    path = d.target.removeprefix("unix://")
    raw: list[socket.socket] = []
    channel = None
    try:
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            raw.append(s)
        # Retries every 0.2-0.5 s, so it gets in soon after a slot is given back.
        fast_retry = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 500)]
        channel = grpc.insecure_channel(d.target, options=fast_retry)
        assert _connects(channel, 20.0), "still locked out after 20 s"
        # Served on the connection it got, while the raw ones stay open. (Not over a second
        # connection made at once: in one CI run on a busy machine that one was still refused,
        # "socket closed", while the first was served.)
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        if channel is not None:
            channel.close()
        for s in raw:
            s.close()
        d.stop()


def test_an_idle_connection_is_closed() -> None:
    """Before, a connection that completed the HTTP/2 handshake and never called stayed open
    for good (165 s measured, 600 of 600)."""
    d = start_daemon("--set", "server.idle_connection_s=1")
    channel = _channel(d.target)
    seen: list[grpc.ChannelConnectivity] = []
    channel.subscribe(seen.append, try_to_connect=True)
    try:
        assert _connects(channel, 10.0)
        ready = seen.index(grpc.ChannelConnectivity.READY)
        poll(lambda: seen[ready + 1 :], bool, 15.0, "the idle connection to be closed (a state after READY)")
        assert seen[ready + 1] is grpc.ChannelConnectivity.IDLE
    finally:
        channel.close()
        d.stop()


def test_finished_prefetches_do_not_keep_their_keys(tmp_path: Path) -> None:
    """Before: the index keeps the last 1,024 finished prefetches for their status, and each kept
    its whole key list: 16 Prefetches of 16,384 keys of ~400 bytes (found in L3, timed out at
    once) grew the daemon by about 9 MiB each, for good."""
    d = start_daemon(
        "--l3", "file", "--l3-path", str(tmp_path / "l3"), "--set", "server.max_batch_pages=65536"
    )
    try:
        tiny = pool_spec(  # 32-byte pages: 16,384 of them are 512 KiB of L3
            "kv", role="anchor", kind="mha", dtype="bfloat16", page_size=1, num_layers=1, num_heads=1,
            head_dim=8, host_layout="layer_first", k_buffers=(), v_buffers=(), host_bytes=4096 * 32,
        )  # fmt: skip
        with (
            HiCacheClient(d.target, timeout_s=60) as client,
            client.attach(WorkerIdentity("pf", 1, "m-pf"), [tiny], heartbeat=False) as s,
        ):
            keys = [f"{i:08d}-" + "k" * 400 for i in range(16_384)]
            for at in range(0, len(keys), 2048):
                batch = keys[at : at + 2048]
                s.put_bytes([PageBytes(k, "kv", bytes(32)) for k in batch])
                backed = s.backup(batch, wait=True)  # write-through may have stored some already
                assert backed.stored_pages == backed.queued_pages
            s.prefetch(keys, policy="timeout", timeout_ms=1)  # the allocator's first growth
            before = proc_bytes(d.process.pid, "VmRSS") / MIB
            for _ in range(16):
                assert s.prefetch(keys, policy="timeout", timeout_ms=1).planned_pages > 0
            grown = proc_bytes(d.process.pid, "VmRSS") / MIB - before
            assert grown < 48, f"16 finished prefetches of 16,384 keys grew the daemon by {grown:.0f} MiB"
    finally:
        d.stop()


def _one_byte_pages(host_bytes: int) -> tpb.PoolSpec:
    """A byte-only pool of 1-byte pages (MLA, int8, one layer, head_dim 1, page_size 1)."""
    return pool_spec(
        "kv", role="anchor", kind="mla", dtype="int8", page_size=1, num_layers=1, num_heads=1,
        head_dim=1, host_layout="layer_first", k_buffers=(), host_bytes=host_bytes,
    )  # fmt: skip


def test_tiny_pages_are_charged_their_bookkeeping_against_the_budget() -> None:
    """Before, host.budget charged a pool its segment only: a 63 MiB pool of 1-byte pages
    (66 M pages) was accepted in a 64 MiB budget and grew the daemon by ~570 MiB (its
    free-page stack), and an index full of its pages would have taken 30-160 GB. Now the pages'
    bookkeeping is charged (hicached.core.footprint): that attach is refused naming the budget
    and costs nothing; a pool that fits, every page published under the longest keys, grows
    the daemon by at most what the budget charged for it plus 8 MiB (the session's op cache,
    at most 4 MiB, and the first calls' buffers)."""
    budget = 64 * MIB
    d = start_daemon("--host-budget", str(budget))
    pid = d.process.pid
    try:
        with HiCacheClient(d.target, timeout_s=60) as client, HiCacheClient(d.admin_target) as admin:
            start = proc_bytes(pid, "VmRSS")
            with pytest.raises(HiCacheError) as refused:
                client.attach(WorkerIdentity("tiny", 1, "m-tiny"), [_one_byte_pages(budget - MIB)])
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"host.budget={budget}" in refused.value.message and "bookkeeping" in refused.value.message
            assert admin.get_stats().groups == ()
            grown = (proc_bytes(pid, "VmRSS") - start) / MIB
            assert grown < 8, f"a refused attach grew the daemon by {grown:.0f} MiB"

            # The most 1-byte pages the budget holds (less a margin for the segment's header).
            per_page = 1 + bookkeeping_bytes(0, allocating=True) + entry_bytes(1, 512)
            pages = (budget - 2 * MIB) // per_page
            with client.attach(WorkerIdentity("tiny", 2, "m-tiny"), [_one_byte_pages(pages)]) as s:
                charged = admin.get_stats().host_used_bytes
                assert charged <= budget
                # The longest keys a client may send (limits.max_key_bytes, 512 UTF-8 bytes),
                # one character beyond U+FFFF making Python store each character in 4 bytes.
                keys = [f"\U0001f600{i:08d}" + "k" * 500 for i in range(pages)]
                for at in range(0, pages, MAX_BATCH_PAGES):
                    batch = keys[at : at + MAX_BATCH_PAGES]
                    assert s.put_bytes([PageBytes(k, "kv", b"x") for k in batch]).stored_pages == len(batch)
                assert admin.get_stats().groups[0].indexed_pages == pages
                grown = (proc_bytes(pid, "VmRSS") - start) / MIB
                bound = charged / MIB + 8
                assert grown < bound, (
                    f"{pages} 1-byte pages grew the daemon by {grown:.1f} MiB, over {bound:.1f}"
                )
    finally:
        d.stop()
