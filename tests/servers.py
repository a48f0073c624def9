"""Real servers on 127.0.0.1 for tests: started as subprocesses, stopped by pid.

Each helper returns a :class:`Server` (a context manager) once the server
answers, or raises with the server's own log when it does not within the
deadline. Add a backend's server as one more ``start_<name>`` function built
on :func:`launch` (the s3 and mooncake servers belong here too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

START_DEADLINE_S = 20.0


def free_port() -> int:
    """A TCP port that was free a moment ago (the caller retries on a lost race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass
class Server:
    name: str
    host: str
    port: int
    process: subprocess.Popen[bytes]
    workdir: Path
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM the server by pid, SIGKILL it after a deadline, and reap it."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_until(ready: Callable[[], bool], server: Server, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}:\n{server.log()}")
        if ready():
            return
        time.sleep(0.02)  # polling a readiness probe with a deadline, not synchronisation
    server.stop()
    raise RuntimeError(f"{server.name} did not become ready within {deadline_s} s:\n{server.log()}")


def launch(
    name: str,
    argv_for_port: Callable[[int], Sequence[str]],
    ready: Callable[[Server], bool],
    workdir: Path,
    *,
    attempts: int = 3,
) -> Server:
    """Start ``argv_for_port(port)`` on a free port in ``workdir`` and wait for ``ready``.

    Retries on a new port when the server dies at start (e.g. the port was taken
    between probing and binding).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    last: Exception | None = None
    for attempt in range(attempts):
        port = free_port()
        log_path = workdir / f"{name}-{attempt}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                list(argv_for_port(port)), cwd=workdir, stdout=log, stderr=subprocess.STDOUT
            )
        server = Server(name, "127.0.0.1", port, process, workdir, log_path)
        try:
            _wait_until(functools.partial(ready, server), server, START_DEADLINE_S)
            return server
        except RuntimeError as exc:
            server.stop()
            last = exc
    raise RuntimeError(f"could not start {name} after {attempts} attempts") from last


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def _redis_ping(server: Server) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((server.host, server.port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False


def start_redis(workdir: Path) -> Server:
    """redis-server on 127.0.0.1 without persistence (the Debian package ``redis-server``)."""
    binary = redis_server_path()
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian package redis-server)")
    return launch(
        "redis-server",
        lambda port: [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        _redis_ping,
        workdir,
    )
