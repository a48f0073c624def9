"""Run the real daemon (``python -m hicached serve``) as a subprocess for the tests.

Readiness is the standard gRPC health service reporting SERVING, polled with a
deadline; the daemon is stopped by its pid (SIGTERM, then SIGKILL after a
grace period).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
HOST_BUDGET = "256MiB"
LEASE_MS = 1500
MAX_BATCH_PAGES = 512


@dataclass
class Daemon:
    target: str
    process: subprocess.Popen[bytes]
    workdir: Path
    shm_prefix: str

    @property
    def admin_target(self) -> str:
        """The admin socket (the daemon's default: admin.sock next to the worker socket)."""
        return f"unix://{self.workdir / 'admin.sock'}"

    @property
    def log(self) -> str:
        path = self.workdir / "daemon.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        # Host-pool segments may outlive the daemon by design (warm restart); ours are test-only.
        for seg in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
        shutil.rmtree(self.workdir, ignore_errors=True)


def wait_serving(target: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Block on the health service's Watch stream (gRPC itself waits for the socket to
    accept) until SERVING; each attempt is bounded so a daemon that died is noticed."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"daemon exited with {process.returncode} before serving")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon at {target} not SERVING within {timeout_s} s")
            try:
                for reply in stub.Watch(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0, wait_for_ready=True
                ):
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError:
                pass  # not accepting yet (the attempt timed out): check the process, go again


def start_daemon(*extra: str, timeout_s: float = 60.0) -> Daemon:
    # Short paths: AF_UNIX socket paths are limited to ~107 bytes.
    workdir = Path("/tmp") / f"hcd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    workdir.mkdir()
    sock = workdir / "d.sock"
    shm_prefix = f"hcdt{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable, "-m", "hicached", "serve",
        "--socket", str(sock),
        "--l3", "none",
        "--host-budget", HOST_BUDGET,
        "--lease-ms", str(LEASE_MS),
        "--set", f"server.max_batch_pages={MAX_BATCH_PAGES}",
        "--set", f"host.shm_prefix={shm_prefix}",
        *extra,
    ]  # fmt: skip
    log = (workdir / "daemon.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    daemon = Daemon(target=f"unix://{sock}", process=process, workdir=workdir, shm_prefix=shm_prefix)
    try:
        wait_serving(daemon.target, process, timeout_s)
    except BaseException as exc:
        text = daemon.log
        daemon.stop()
        raise RuntimeError(f"{exc}\n--- daemon log ---\n{text}") from exc
    return daemon
