"""A second, unprivileged uid for the security tests (CI runs as root).

``other_user()`` creates the user ``hicached-sec`` with ``useradd`` when it is
missing and returns its uid; tests that need it fail when this process is not
root (it cannot run code as another uid at all; CI runs as root).

``run_as_other`` runs a Python client as that uid with ``runuser``. Where the
interpreter lives under a directory the user cannot traverse (a pyenv under a
0700 /root), it uses ``setpriv`` with the one capability CAP_DAC_READ_SEARCH so
the interpreter and its packages can be read: the process still has the other
uid and gid, which is all the daemon looks at (SO_PEERCRED, socket permissions).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

USER = "hicached-sec"
NOBODY = 65534
ROOT = Path(__file__).resolve().parents[2]


def other_user() -> int:
    """The uid of the unprivileged test user (created if missing); skips unless root."""
    if os.geteuid() != 0:
        pytest.fail("needs root to run a client as a second uid: run the suite as root, as CI does")
    try:
        return pwd.getpwnam(USER).pw_uid
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    assert useradd, "useradd is missing: cannot create the second user"
    subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True
    )
    return pwd.getpwnam(USER).pw_uid


def _as_other_prefix() -> list[str]:
    runuser = shutil.which("runuser")
    assert runuser, "runuser is missing"
    probe = subprocess.run(
        [runuser, "-u", USER, "--", sys.executable, "-c", "pass"], capture_output=True, check=False
    )
    if probe.returncode == 0:
        return [runuser, "-u", USER, "--"]
    setpriv = shutil.which("setpriv")
    assert setpriv, f"{sys.executable} is not readable by {USER} and setpriv is missing"
    return [
        setpriv, f"--reuid={USER}", f"--regid={USER}", "--clear-groups",
        "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
    ]  # fmt: skip


def popen_as_other(code: str, *args: str) -> subprocess.Popen[str]:
    """Start ``python -c code args`` as the test user (stdin, stdout piped; text); the caller
    waits for it and closes it."""
    env = _env()  # creates the user first
    return subprocess.Popen(
        [*_as_other_prefix(), sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/",
    )


def _env() -> dict[str, str]:
    other_user()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    # The checkout first; then the caller's own entries, where its packages may live (an
    # image whose interpreter takes wheels from PYTHONPATH, as on the GPU machines).
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "clients" / "python"), *inherited])
    env["HOME"] = "/tmp"
    return env


def run_as_other(code: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code args`` as the test user with this checkout on the path."""
    env = _env()
    return subprocess.run(
        [*_as_other_prefix(), sys.executable, "-c", code, *args],
        check=False,  # callers assert on the return code with stderr in the message
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd="/",
    )


def as_nobody() -> list[str]:
    """The command prefix that runs a daemon as ``nobody`` (root is exempt from RLIMIT_NPROC
    and from file modes: tests of those limits need another uid). Needs root, as CI runs."""
    assert os.geteuid() == 0, "needs root to run the daemon as nobody: run the suite as root, as CI does"
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv is missing"
    # CAP_DAC_READ_SEARCH only to read an interpreter under a 0700 home; it grants no write.
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]  # fmt: skip


def unused_uids(n: int) -> list[int]:
    """``n`` uids no account has (more uids besides root and :func:`other_user`'s)."""
    taken = {e.pw_uid for e in pwd.getpwall()}
    return [uid for uid in range(61000, 62000) if uid not in taken][:n]


def connections_as(uid: int, path: Path, n: int) -> list[socket.socket]:
    """``n`` connections to ``path`` made by a child running as ``uid`` (their ``SO_PEERCRED``),
    handed back here: this process holds them idle. The child is forked (the interpreter under
    /root is not executable by another user) and only connects before ``_exit``."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            ours.close()
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            conns = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
            for c in conns:
                c.connect(str(path))
            socket.send_fds(theirs, [b"x"], [c.fileno() for c in conns])
        except BaseException:
            code = 1
        os._exit(code)
    theirs.close()
    try:
        _, fds, _, _ = socket.recv_fds(ours, 1, n)
    finally:
        ours.close()
        _, status = os.waitpid(pid, 0)
    conns = [socket.socket(fileno=fd) for fd in fds]
    if os.waitstatus_to_exitcode(status) != 0 or len(conns) != n:
        for c in conns:
            c.close()
        raise AssertionError(f"uid {uid} could not open {n} connections to {path}")
    return conns
