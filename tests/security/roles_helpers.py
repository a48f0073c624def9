"""Helpers of the trust-roles security tests (issue 9 items 4-7): short-lived ``hicached serve``
runs that must refuse to start, a second uid, and raw socket connects made as that uid."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from hicached.testing import daemon as harness
from hicached.testing.daemon import Daemon, scratch_dir
from tests.support.daemon import ROOT

OTHER_USER = "hicached-sectest"


def serve(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``hicached serve ARGS`` expected to exit by itself (a refused start); its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    cmd = [sys.executable, "-m", "hicached", "serve", "--l3", "none", "--host-budget", "64MiB", *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """A refused start: exit 2 and exactly one line on stderr (no traceback); that line."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def other_user() -> tuple[int, int]:
    """(uid, gid) of a second, unprivileged user, created when missing (needs root, as CI runs)."""
    if os.geteuid() != 0:
        pytest.fail("needs root to create and impersonate a second user: run the suite as root, as CI does")
    try:
        entry = pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(OTHER_USER)
    return entry.pw_uid, entry.pw_gid


def connect_as(uid: int, gid: int, path: Path) -> int:
    """Connect to the Unix socket ``path`` from a child running as ``uid``: 0 or the errno.

    The child is forked (the interpreter under /root is not executable by another
    user) and only makes the raw connect, no gRPC, before ``_exit``.
    """
    import socket

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))
        except OSError as exc:
            code = exc.errno or 255
        except BaseException:
            code = 254
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def launch(workdir: Path, *args: str, sock: Path | None = None, timeout_s: float = 60.0) -> Daemon:
    """A serving daemon whose worker socket is ``sock`` (default ``workdir/d.sock``, admin.sock
    next to it); ``Daemon.stop`` removes ``workdir``."""
    return harness.launch(
        "--l3", "none", "--host-budget", "64MiB", *args,
        workdir=workdir, socket=sock, owns_workdir=True, cwd=ROOT, timeout_s=timeout_s,
    )  # fmt: skip


__all__ = ["OTHER_USER", "connect_as", "launch", "one_line_error", "other_user", "scratch_dir", "serve"]
