"""TCP clients cannot hand over memory: a handoff ticket or an fd handle over TCP is refused
(byte-only sessions stay available), and a TCP session also needs its secret."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity, _calls, pool_spec
from hicached_client._handoff import hand_over, handoff_path
from hicached_client.export import ShmKVPool
from hicached_client.v1 import types_pb2 as tpb

from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import unique_tag
from tests.support.state import state

TOKEN = "tcp-memory-token"
C = grpc.StatusCode


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    token_file = Path(tmp_path_factory.mktemp("token")) / "token"
    token_file.write_text(TOKEN + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = start_daemon("--listen", f"127.0.0.1:{port}", "--set", f"server.auth_token_file={token_file}")
    try:
        yield daemon, f"127.0.0.1:{port}"
    finally:
        daemon.stop()


def spec(k: list[tpb.DeviceBuffer], v: list[tpb.DeviceBuffer]) -> list[tpb.PoolSpec]:
    return [
        pool_spec(
            "kv",
            role="anchor",
            kind="mha",
            dtype="float16",
            page_size=4,
            num_layers=1,
            num_heads=2,
            head_dim=16,
            k_buffers=k,
            v_buffers=v,
            host_bytes=1 << 20,
        )
    ]


def test_a_ticket_over_tcp_is_refused_and_not_consumed(tcp_daemon: tuple[Daemon, str]) -> None:
    daemon, tcp = tcp_daemon
    path = handoff_path(daemon.target)
    assert path is not None
    with ShmKVPool(
        unique_tag("tcp"), num_layers=1, tokens=64, heads=2, head_dim=16, dtype=torch.float16
    ) as kv:
        ticket = hand_over(path, [kv.fd], timeout_s=10)
        assert ticket
        wire = spec(kv.k_buffers(), kv.v_buffers())
        for buf in (*wire[0].k_buffers, *wire[0].v_buffers):
            buf.handle.fd.fd_index = 0
        ident = WorkerIdentity(unique_tag("tcp"), 1, "m-tcp")
        with HiCacheClient(tcp, token=TOKEN, timeout_s=10) as remote:
            before = state(remote)
            with pytest.raises(HiCacheError) as info:
                remote.invoke(_calls.attach("", ident, wire, 0, ticket))
            assert info.value.code == C.INVALID_ARGUMENT
            assert "only be handed over on the Unix socket" in info.value.message
            with pytest.raises(HiCacheError) as info:
                remote.invoke(_calls.attach("", ident, wire, 0, ""))
            assert info.value.code == C.INVALID_ARGUMENT and "handoff_ticket" in info.value.message
            assert state(remote) == before
        # The ticket was not consumed by the refused TCP call: its owner still attaches with it.
        with HiCacheClient(daemon.target, timeout_s=10) as local:
            info_ = local.invoke(_calls.attach("", ident, wire, 0, ticket))
            local.session(info_.session_id, session_secret=info_.session_secret).detach()


def test_a_byte_only_tcp_session_works_and_needs_its_secret(tcp_daemon: tuple[Daemon, str]) -> None:
    _, tcp = tcp_daemon
    with HiCacheClient(tcp, token=TOKEN, timeout_s=10) as remote:
        session = remote.attach(
            WorkerIdentity(unique_tag("bytes"), 1, "m-tcp"), spec([], []), heartbeat=False
        )
        assert len(session.info.session_secret) == 32
        assert session.heartbeat() > 0
        with pytest.raises(HiCacheError) as info:
            remote.session(session.session_id).heartbeat()
        assert info.value.code == C.PERMISSION_DENIED
        session.detach()
