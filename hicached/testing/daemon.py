"""The real daemon (``python -m hicached serve``) as a subprocess, for the tests and the benchmarks.

Readiness is the standard gRPC health service reporting SERVING, polled with a deadline on the
health Watch stream; a daemon that exits first is reported with the end of its log. It is
stopped by its pid (SIGTERM, then SIGKILL after a grace period). A :class:`Daemon` is owned by
the caller that launched it; its methods are not meant to be called from several threads at once.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hicached.testing.procs import child_env, log_tail

__all__ = ["Daemon", "DaemonDied", "launch", "scratch_dir", "wait_serving"]

SHM = Path("/dev/shm")


class DaemonDied(RuntimeError):
    """The daemon exited (or never answered); the message carries the end of its log."""


@dataclass
class Daemon:
    """A launched ``hicached serve``. ``workdir`` holds ``daemon.log``; it is removed by
    :meth:`stop` when ``owns_workdir`` (the launcher made it)."""

    target: str
    process: subprocess.Popen[bytes]
    workdir: Path
    shm_prefix: str
    log_path: Path
    owns_workdir: bool = True

    @property
    def socket(self) -> Path:
        return Path(self.target.removeprefix("unix://"))

    @property
    def admin_target(self) -> str:
        """The admin socket (the daemon's default: admin.sock next to the worker socket)."""
        return f"unix://{self.socket.parent / 'admin.sock'}"

    @property
    def log(self) -> str:
        """Everything the daemon has written to its log so far."""
        path = self.log_path
        return path.read_text(errors="replace") if path.exists() else ""

    def died(self, when: str) -> DaemonDied:
        """The error for a daemon found exited ``when`` (e.g. "while the benchmark ran")."""
        return DaemonDied(
            f"the daemon exited with code {self.process.returncode} {when}; "
            f"the end of its log ({self.log_path}):\n{log_tail(self.log_path, 40)}"
        )

    def terminate(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, SIGKILL after ``timeout_s``; its exit status (negative: the signal that
        ended it). Leaves everything the daemon left behind in place, to be inspected."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return int(self.process.returncode)

    def stop(self, timeout_s: float = 20.0) -> int:
        """:meth:`terminate`, then remove the host segments of its prefix (they may outlive a
        daemon by design, for a warm restart) and an owned ``workdir``; the exit status."""
        code = self.terminate(timeout_s)
        for seg in SHM.glob(f"{self.shm_prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return code


def scratch_dir(prefix: str = "hcd") -> Path:
    """A new short directory under /tmp (AF_UNIX socket paths are limited to ~107 bytes)."""
    path = Path("/tmp") / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    return path


def wait_serving(target: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Block on the health service's Watch stream (gRPC itself waits for the socket to
    accept) until SERVING; each attempt is bounded so a daemon that died is noticed.

    Raises :class:`DaemonDied` when ``process`` exits first, :class:`TimeoutError` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise DaemonDied(f"daemon exited with code {process.returncode} before it was ready")
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


def launch(
    *args: str,
    workdir: Path | None = None,
    socket: Path | None = None,
    shm_prefix: str | None = None,
    env: Mapping[str, str] | None = None,
    clean_env: bool = True,
    cwd: Path | None = None,
    owns_workdir: bool | None = None,
    log_name: str = "daemon.log",
    timeout_s: float = 60.0,
    pass_fds: Sequence[int] = (),
) -> Daemon:
    """``python -m hicached serve --socket SOCKET --set host.shm_prefix=PREFIX ARGS``, waited
    for until SERVING.

    ``workdir`` (default: a new :func:`scratch_dir`, removed by :meth:`Daemon.stop`) holds
    its log (``log_name``) and, unless ``socket`` says otherwise, ``d.sock``. ``shm_prefix``
    defaults to a unique one. The child's environment is ``env`` (default this process's)
    without ``HICACHED_*`` when ``clean_env``, importing this very hicached (:func:`child_env`);
    it runs in ``cwd`` (default ``workdir``) and inherits ``pass_fds`` (a ``--config /dev/fd/N``). ``owns_workdir`` (default: whether the launcher
    made it) says whether :meth:`Daemon.stop` removes ``workdir``. If it exits or is not
    SERVING within ``timeout_s``, it is stopped and :class:`DaemonDied` raised with the end of
    its log.
    """
    owns = workdir is None if owns_workdir is None else owns_workdir
    workdir = scratch_dir() if workdir is None else workdir
    sock = socket or workdir / "d.sock"
    prefix = shm_prefix or f"hcdt{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "hicached", "serve", "--socket", str(sock),
           "--set", f"host.shm_prefix={prefix}", *args]  # fmt: skip
    log_path = workdir / log_name
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd,
            cwd=cwd or workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env(env, clean=clean_env),
            pass_fds=tuple(pass_fds),
        )
    daemon = Daemon(f"unix://{sock}", process, workdir, prefix, log_path, owns_workdir=owns)
    try:
        wait_serving(daemon.target, process, timeout_s)
    except (DaemonDied, TimeoutError) as exc:
        exited, tail = process.poll() is not None, log_tail(log_path, 40)
        daemon.stop()  # an owned workdir goes, and its log with it: the tail was read first
        what = f"the daemon exited with code {process.returncode} before it was ready" if exited else str(exc)
        raise DaemonDied(f"{what}; the end of its log ({log_path}):\n{tail}") from exc
    except BaseException:
        daemon.stop()
        raise
    return daemon
