"""Issue 9 item 6: TCP and TLS fail closed.

Attacks tried on main (each test fails there): ``--listen`` without a token
served every RPC; an empty token file accepted ``Bearer ``; ``tls_client_ca``
without a certificate served plaintext; reflection answered without the token;
a garbage PEM aborted the process (exit -6) instead of a config error.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hicached_client import HiCacheClient

from tests.security.roles_helpers import launch, one_line_error, scratch_dir, serve
from tests.support.daemon import Daemon

TOKEN = "worker-token-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = scratch_dir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def refused(workdir: Path, *args: str) -> str:
    """``serve`` with TCP ``args``: exit 2, one line (returned); nothing listens on the socket."""
    line = one_line_error(
        serve("--socket", str(workdir / "d.sock"), "--listen", f"127.0.0.1:{free_port()}", *args)
    )
    assert line.startswith("hicached: configuration error: "), line
    assert not (workdir / "d.sock").exists()
    return line


def test_listen_without_token_or_mtls_refuses_to_start(workdir: Path) -> None:
    line = refused(workdir)
    assert "server.listen" in line and "server.auth_token_file" in line and "server.insecure_tcp" in line


def test_an_empty_token_file_is_a_config_error(workdir: Path) -> None:
    token = workdir / "token"
    token.write_text("  \n")
    line = refused(workdir, "--set", f"server.auth_token_file={token}")
    assert "server.auth_token_file" in line and "empty" in line


def test_a_missing_token_file_is_a_config_error(workdir: Path) -> None:
    line = refused(workdir, "--set", f"server.auth_token_file={workdir / 'nope'}")
    assert "server.auth_token_file" in line and "cannot read" in line


def test_an_admin_token_equal_to_the_worker_token_is_refused(workdir: Path) -> None:
    token = workdir / "token"
    token.write_text(TOKEN)
    line = refused(
        workdir, "--set", f"server.auth_token_file={token}", "--set", f"server.admin_token_file={token}"
    )
    assert "server.admin_token_file" in line and "must differ" in line


def test_tls_client_ca_without_a_certificate_is_refused(workdir: Path) -> None:
    ca = workdir / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    line = refused(workdir, "--set", f"server.tls_client_ca={ca}")
    assert "server.tls_client_ca" in line and "server.tls_cert" in line


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return key, cert


@pytest.mark.parametrize("bad", ["tls_cert", "tls_key", "tls_client_ca"])
def test_a_garbage_pem_is_a_config_error_not_an_abort(workdir: Path, bad: str) -> None:
    key, cert = _self_signed(workdir)
    garbage = workdir / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    files = {"tls_cert": cert, "tls_key": key, "tls_client_ca": cert, bad: garbage}
    token = workdir / "token"
    token.write_text(TOKEN)
    args = [arg for k, v in files.items() for arg in ("--set", f"server.{k}={v}")]
    line = refused(workdir, *args, "--set", f"server.auth_token_file={token}")
    assert f"server.{bad} = '{garbage}'" in line, line


def test_an_unreadable_pem_is_a_config_error(workdir: Path) -> None:
    key, _ = _self_signed(workdir)
    token = workdir / "token"
    token.write_text(TOKEN)
    line = refused(
        workdir,
        "--set", f"server.tls_cert={workdir / 'missing.pem'}",
        "--set", f"server.tls_key={key}",
        "--set", f"server.auth_token_file={token}",
    )  # fmt: skip
    assert "server.tls_cert" in line and "cannot read" in line


@pytest.fixture(scope="module")
def tcp_daemon() -> Iterator[tuple[Daemon, str]]:
    workdir = scratch_dir()
    (workdir / "token").write_text(TOKEN)
    port = free_port()
    d = launch(
        workdir, "--listen", f"127.0.0.1:{port}", "--set", f"server.auth_token_file={workdir / 'token'}"
    )
    try:
        yield d, f"127.0.0.1:{port}"
    finally:
        d.stop()


def _list_services(target: str, metadata: tuple[tuple[str, str], ...] = ()) -> list[str]:
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=metadata)
        return [s.name for reply in replies for s in reply.list_services_response.service]


def test_reflection_over_tcp_needs_the_token(tcp_daemon: tuple[Daemon, str]) -> None:
    daemon, tcp = tcp_daemon
    with pytest.raises(grpc.RpcError) as info:
        _list_services(tcp)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        _list_services(tcp, (("authorization", "Bearer "),))  # an empty token is no token
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "hicached.v1.HiCacheService" in _list_services(tcp, (("authorization", f"Bearer {TOKEN}"),))
    assert "hicached.v1.HiCacheService" in _list_services(daemon.target), "the Unix socket needs no token"


def test_health_over_tcp_stays_open_for_probes(tcp_daemon: tuple[Daemon, str]) -> None:
    _, tcp = tcp_daemon
    with grpc.insecure_channel(tcp) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_insecure_tcp_starts_and_warns_at_every_start() -> None:
    port = free_port()
    d = launch(scratch_dir(), "--listen", f"127.0.0.1:{port}", "--set", "server.insecure_tcp=true")
    try:
        with HiCacheClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            assert client.ping(b"open") == b"open"
            assert client.get_stats().sessions == (), "an insecure TCP client is a worker, not an admin"
        assert "WARNING" in d.log and "server.insecure_tcp" in d.log
    finally:
        d.stop()
