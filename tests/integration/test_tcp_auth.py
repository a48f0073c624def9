"""TCP listener with a bearer token: calls without it are UNAUTHENTICATED and change nothing,
the Unix socket needs no token, and the health service answers probes without one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hicached_client import HiCacheClient, HiCacheError

from tests.support.daemon import Daemon, start_daemon

TOKEN = "s3cret-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    token_file = Path(tmp_path_factory.mktemp("token")) / "token"
    token_file.write_text(TOKEN + "\n")
    port = _free_port()
    daemon = start_daemon("--listen", f"127.0.0.1:{port}", "--set", f"server.auth_token_file={token_file}")
    try:
        yield daemon, f"127.0.0.1:{port}"
    finally:
        daemon.stop()


def test_tcp_without_token_is_unauthenticated(tcp_daemon: tuple[Daemon, str]) -> None:
    _, tcp = tcp_daemon
    with HiCacheClient(tcp, timeout_s=10) as client, pytest.raises(HiCacheError) as info:
        client.get_stats()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token" in info.value.message
    with HiCacheClient(tcp, token="wrong", timeout_s=10) as client, pytest.raises(HiCacheError) as info:
        client.ping(b"x")
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_tcp_with_token_and_unix_socket_without(tcp_daemon: tuple[Daemon, str]) -> None:
    daemon, tcp = tcp_daemon
    with HiCacheClient(tcp, token=TOKEN, timeout_s=10) as client:
        assert client.ping(b"hello") == b"hello"
        assert client.get_stats().sessions == ()
    with HiCacheClient(daemon.target, timeout_s=10) as client:
        assert client.ping(b"unix") == b"unix"


def test_health_answers_probes_without_token(tcp_daemon: tuple[Daemon, str]) -> None:
    _, tcp = tcp_daemon
    with grpc.insecure_channel(tcp) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A throwaway certificate for localhost, made with the openssl CLI."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return key, cert


def test_tls_listener_serves_clients_that_trust_its_certificate(tmp_path: Path) -> None:
    key, cert = _self_signed(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    port = _free_port()
    daemon = start_daemon(
        "--listen", f"localhost:{port}",
        "--set", f"server.tls_cert={cert}",
        "--set", f"server.tls_key={key}",
        "--set", f"server.auth_token_file={token_file}",
    )  # fmt: skip
    try:
        trusted = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with HiCacheClient(f"localhost:{port}", credentials=trusted, token=TOKEN, timeout_s=10) as client:
            assert client.ping(b"tls") == b"tls"
        with HiCacheClient(f"localhost:{port}", timeout_s=5) as plain, pytest.raises(HiCacheError) as info:
            plain.ping(b"plaintext")  # a plaintext client cannot talk to the TLS port
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        for _ in range(20):  # strangers' failed handshakes: none writes to the log (before: one line each)
            with socket.create_connection(("localhost", port), timeout=10) as stranger:
                stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
                while stranger.recv(4096):  # until the daemon closes it, after its handshake failed
                    pass
        assert "Handshake failed" not in daemon.log, daemon.log[-2000:]
        # The CLI asks the same TLS listener with the same credentials (before: it had no flag
        # for either, and every TCP call was UNAUTHENTICATED).
        tcp = ("--target", f"localhost:{port}", "--tls-ca", str(cert))
        status = _cli("status", *tcp, "--token-file", str(token_file), "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["draining"] is False, status.stderr
        health = _cli("status", *tcp, "--health-only")
        assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
        tokenless = _cli("status", *tcp)
        assert tokenless.returncode == 1 and "UNAUTHENTICATED" in tokenless.stderr, tokenless.stderr
        assert "--token-file" in tokenless.stderr, tokenless.stderr
        missing = _cli("status", *tcp, "--token-file", str(tmp_path / "nowhere"))
        assert (
            missing.returncode == 2 and "--token-file" in missing.stderr and "Traceback" not in missing.stderr
        )
    finally:
        daemon.stop()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    return subprocess.run(
        [sys.executable, "-m", "hicached", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
