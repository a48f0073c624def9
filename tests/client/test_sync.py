"""The blocking client against a real gRPC server: errors, retries, op_ids, heartbeat, streams."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from hicached_client import (
    NO_RETRY,
    HiCacheClient,
    HiCacheError,
    LoadProgress,
    PoolRole,
    RetryPolicy,
    Transfer,
    WorkerIdentity,
    WriteResult,
    pool_spec,
)

from tests.client.scripted import GONE_SESSION, RETRY_AFTER_MS, SESSION, ScriptedServer

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02)


def _client(server: ScriptedServer, **kwargs: object) -> HiCacheClient:
    kwargs.setdefault("retry", FAST_RETRY)
    return HiCacheClient(server.target, timeout_s=10.0, **kwargs)  # type: ignore[arg-type]


def test_error_is_one_type_with_code_and_server_message(scripted_server: ScriptedServer) -> None:
    with _client(scripted_server) as client:
        session = client.session(SESSION)
        with pytest.raises(HiCacheError) as info:
            session.free("kv", [1, 3, 3])
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == "duplicate host page 3 in pool 'kv'"
    assert err.retry_after_ms is None
    assert err.method == "Free"
    assert not isinstance(err, grpc.RpcError)
    assert "INVALID_ARGUMENT" in str(err) and "duplicate host page 3" in str(err)
    # Not a transient code: sent exactly once.
    assert len(scripted_server.servicer.op_ids["Free"]) == 1


def test_resource_exhausted_carries_retry_hint_and_is_not_retried_by_default(
    scripted_server: ScriptedServer,
) -> None:
    with _client(scripted_server) as client, pytest.raises(HiCacheError) as info:
        client.session(SESSION).alloc("full", 4)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.retry_after_ms == RETRY_AFTER_MS
    assert info.value.message == "host budget exhausted: 0 of 64 pages free"
    assert len(scripted_server.servicer.op_ids["Alloc"]) == 1


def test_resource_exhausted_retry_is_opt_in_and_reuses_op_id(scripted_server: ScriptedServer) -> None:
    policy = RetryPolicy(max_attempts=2, retry_resource_exhausted=True)
    with _client(scripted_server, retry=policy) as client:
        started = time.monotonic()
        with pytest.raises(HiCacheError):
            client.session(SESSION).alloc("full", 4)
        elapsed = time.monotonic() - started
    ops = scripted_server.servicer.op_ids["Alloc"]
    assert len(ops) == 2 and ops[0] == ops[1]
    assert elapsed >= RETRY_AFTER_MS / 1000.0  # the daemon's hint was honoured


def test_transient_failures_are_retried_with_the_same_op_id(scripted_server: ScriptedServer) -> None:
    scripted_server.servicer.script.fail_first["Alloc"] = 2
    with _client(scripted_server) as client:
        result = client.session(SESSION).alloc("kv", 4)
    assert result.ok and result.host_pages == (0, 1, 2, 3)
    ops = scripted_server.servicer.op_ids["Alloc"]
    assert len(ops) == 3
    assert len(set(ops)) == 1 and len(ops[0]) == 32


def test_retries_are_bounded(scripted_server: ScriptedServer) -> None:
    scripted_server.servicer.script.fail_first["Alloc"] = 10
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.01)
    with _client(scripted_server, retry=policy) as client, pytest.raises(HiCacheError) as info:
        client.session(SESSION).alloc("kv", 1)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert info.value.message == "Alloc: scripted transient failure"
    assert len(scripted_server.servicer.op_ids["Alloc"]) == 3


def test_no_retry_policy_sends_once(scripted_server: ScriptedServer) -> None:
    scripted_server.servicer.script.fail_first["Alloc"] = 1
    with _client(scripted_server, retry=NO_RETRY) as client, pytest.raises(HiCacheError):
        client.session(SESSION).alloc("kv", 1)
    assert len(scripted_server.servicer.op_ids["Alloc"]) == 1


def test_each_call_gets_a_fresh_op_id_unless_given(scripted_server: ScriptedServer) -> None:
    with _client(scripted_server) as client:
        session = client.session(SESSION)
        session.alloc("kv", 1)
        session.alloc("kv", 1)
        session.alloc("kv", 1, op_id="mine")
    ops = scripted_server.servicer.op_ids["Alloc"]
    assert ops[0] != ops[1] and ops[2] == "mine"


def test_unreachable_daemon_is_unavailable(tmp_path: object) -> None:
    with HiCacheClient("/nonexistent/hicached-test.sock", retry=NO_RETRY, timeout_s=2.0) as client:
        with pytest.raises(HiCacheError) as info:
            client.ping(b"x")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(HiCacheError) as ready:
            client.wait_ready(0.05)
        assert ready.value.code == grpc.StatusCode.UNAVAILABLE


def test_bearer_token_is_sent_on_every_call(scripted_server: ScriptedServer) -> None:
    with _client(scripted_server, token="s3cret") as client:
        client.ping(b"a")
        client.drain(wait_flush=True)
    assert [m.get("authorization") for m in scripted_server.servicer.metadata] == ["Bearer s3cret"] * 2


def test_attach_heartbeats_at_a_third_of_the_lease_and_stops_on_detach(
    scripted_server: ScriptedServer,
) -> None:
    servicer = scripted_server.servicer
    kv = pool_spec(
        "kv",
        role="anchor",
        kind="mha",
        dtype="float16",
        page_size=16,
        num_layers=2,
        num_heads=1,
        head_dim=8,
        k_buffers=[],
        v_buffers=[],
    )
    with _client(scripted_server) as client:
        started = time.monotonic()
        session = client.attach(WorkerIdentity("w0", model_name="m"), [kv], lease_ms=150)
        assert session.session_id == SESSION
        assert session.info.pool("kv").role is PoolRole.ANCHOR
        assert session.heartbeat_running
        assert servicer.heartbeat_event.wait(5.0)
        # Three beats at lease/3 = 50 ms take at least 150 ms.
        assert time.monotonic() - started >= 0.15
        freed = session.detach()
        assert freed == 3
        assert not session.heartbeat_running
        count = servicer.heartbeats
        session.close()  # already detached: no second Detach
    assert len(servicer.op_ids["Detach"]) == 1
    assert servicer.heartbeats == count
    assert all(r.session_id == SESSION for r in servicer.requests["Heartbeat"])


def test_heartbeat_stops_when_the_lease_is_lost(scripted_server: ScriptedServer) -> None:
    with _client(scripted_server) as client:
        session = client.session(GONE_SESSION, lease_ms=30, heartbeat=True)
        beat = session._beat  # the heartbeat thread ends by itself once the lease is lost
        assert beat is not None
        beat._thread.join(timeout=5.0)
        assert not session.heartbeat_running
        assert session.lease_lost is not None
        assert session.lease_lost.code == grpc.StatusCode.NOT_FOUND
        assert GONE_SESSION in session.lease_lost.message


def test_session_context_manager_detaches(scripted_server: ScriptedServer) -> None:
    with (
        _client(scripted_server) as client,
        client.attach(WorkerIdentity("w"), [], heartbeat=False) as session,
    ):
        assert not session.heartbeat_running
    assert [r.session_id for r in scripted_server.servicer.requests["Detach"]] == [SESSION]


def test_write_converts_numpy_inputs_and_returns_dataclasses(scripted_server: ScriptedServer) -> None:
    with _client(scripted_server) as client:
        result = client.session(SESSION).write(
            [Transfer("kv", np.arange(4, dtype=np.int64)), Transfer("draft", [7, 8], host_pages=[1, 2])],
            allocate=True,
            primary_device_pages=np.array([0, 1, 2, 3]),
        )
    assert isinstance(result, WriteResult) and result.ok
    kv, draft = result.transfers
    assert kv == Transfer("kv", (0, 1, 2, 3), (100, 101, 102, 103), host_allocated=True)
    assert draft == Transfer("draft", (7, 8), (1, 2), host_allocated=False)
    assert [(a.pool, a.pages, a.tokens, a.bytes) for a in result.acks] == [
        ("kv", 4, 64, 16384),
        ("draft", 2, 32, 8192),
    ]
    sent = scripted_server.servicer.requests["Write"][0]
    assert sent.allocate and list(sent.batch.primary_device_pages) == [0, 1, 2, 3]
    assert sent.session_id == SESSION and len(sent.op_id) == 32


def test_bad_local_inputs_raise_before_sending(scripted_server: ScriptedServer) -> None:
    with _client(scripted_server) as client:
        session = client.session(SESSION)
        with pytest.raises(ValueError, match="ndim=2"):
            session.write([Transfer("kv", np.zeros((2, 2), dtype=np.int64))])
        with pytest.raises(TypeError, match="single Transfer"):
            session.write(Transfer("kv", [1]))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="keys must be"):
            session.lookup("abc")
    assert scripted_server.servicer.requests["Write"] == []


def test_load_stream_reports_layers_then_acks(scripted_server: ScriptedServer) -> None:
    with _client(scripted_server) as client:
        session = client.session(SESSION)
        items = list(session.load([Transfer("kv", [5, 6], host_pages=[1, 2])]))
        result = session.load_wait([Transfer("kv", [5], host_pages=[1])], layer_progress=False)
    assert [p.layer for p in items] == [0, 1, 2, 2]
    assert [p.done for p in items] == [False, False, False, True]
    assert items[-1].acks[0].pool == "kv" and items[-1].acks[0].pages == 2
    assert isinstance(items[0], LoadProgress)
    assert result.layers == () and result.acks[0].pages == 1


def test_load_retries_before_the_first_message_with_the_same_op_id(scripted_server: ScriptedServer) -> None:
    scripted_server.servicer.script.fail_first["Load"] = 1
    with _client(scripted_server) as client:
        result = client.session(SESSION).load_wait([Transfer("kv", [1], host_pages=[2])])
    assert result.layers == (0, 1, 2)
    ops = scripted_server.servicer.op_ids["Load"]
    assert len(ops) == 2 and ops[0] == ops[1]


def test_load_failure_mid_stream_raises_and_is_not_retried(scripted_server: ScriptedServer) -> None:
    scripted_server.servicer.script.load_fail_after = 1
    with _client(scripted_server) as client:
        stream = client.session(SESSION).load([Transfer("kv", [1], host_pages=[2])])
        assert next(stream).layer == 0
        with pytest.raises(HiCacheError) as info:
            next(stream)
        with pytest.raises(StopIteration):
            next(stream)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert info.value.message == "layer 1: scripted failure"
    assert info.value.method == "Load"
    assert len(scripted_server.servicer.op_ids["Load"]) == 1


def test_stats_and_admin_results_are_typed(scripted_server: ScriptedServer) -> None:
    with _client(scripted_server) as client:
        stats = client.get_stats()
        assert client.ping(b"\x00\x01") == b"\x00\x01"
        assert client.drain(wait_flush=True).flushed_pages == 7
    assert stats.version == "test" and stats.host_used_bytes == 4096
    assert stats.free_pages() == {"g1/kv": 60}
    info = stats.session(SESSION)
    assert info is not None and info.identity.tp_size == 2 and info.owned_pages == 4
    assert stats.session("nope") is None


def test_closing_the_client_stops_session_heartbeats(scripted_server: ScriptedServer) -> None:
    client = _client(scripted_server)
    scripted_server.servicer.heartbeat_target = 1
    session = client.attach(WorkerIdentity("w"), [], lease_ms=60)
    assert scripted_server.servicer.heartbeat_event.wait(timeout=5.0)  # the server saw one
    client.close()
    assert not session.heartbeat_running
    assert session.lease_lost is None
