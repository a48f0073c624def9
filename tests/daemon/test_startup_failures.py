"""A start the operator's configuration makes fail: one line naming the key, exit 2, and no
socket left behind; signals during a long start are handled (review 28, findings 4 and 7)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from hicached_client import HiCacheClient

from hicached.testing.daemon import launch, scratch_dir
from hicached.testing.procs import child_env
from tests.daemon.conftest import free_port
from tests.support.faults import log_lines, serve_patched, socket_files
from tests.support.state import poll


def _serve(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    prefix = f"hcds{uuid.uuid4().hex[:8]}"
    return subprocess.run(
        [sys.executable, "-m", "hicached", "serve", "--socket", str(workdir / "d.sock"), "--l3", "none",
         "--host-budget", "64MiB", "--set", f"host.shm_prefix={prefix}", "--set", "host.prefault=false",
         *args],
        cwd=workdir, env=child_env(clean=True), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _refused(workdir: Path, result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hicached: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for needle in needles:
        assert needle in last, (needle, last)
    assert socket_files(workdir) == [], "the sockets the failed start had published are unlinked"


def test_metrics_port_in_use_is_one_line_and_leaves_no_socket() -> None:
    """Fails before the fix: a 19-frame OSError traceback, exit 1, and the worker, admin,
    handoff and lane sockets stayed (they are published before the metrics server starts)."""
    workdir = scratch_dir("hcds")
    try:
        with socket.create_server(("127.0.0.1", 0)) as taken:
            port = taken.getsockname()[1]
            result = _serve(workdir, "--metrics-port", str(port))
        _refused(workdir, result, "server.metrics_port", str(port))
    finally:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)


def test_listen_address_that_cannot_be_bound_is_one_line_and_leaves_no_socket() -> None:
    """Fails before the fix: gRPC's RuntimeError as a traceback, exit 1, sockets left."""
    workdir = scratch_dir("hcds")
    try:
        # 192.0.2.1 (TEST-NET-1) is no address of this host: the bind fails.
        address = f"192.0.2.1:{free_port()}"
        result = _serve(workdir, "--listen", address, "--set", "server.insecure_tcp=true")
        _refused(workdir, result, "server.listen", address)
    finally:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)


def test_unusable_journal_dir_is_one_line() -> None:
    """Fails before the fix: FailedPrecondition as a traceback, exit 1."""
    workdir = scratch_dir("hcds")
    try:
        result = _serve(workdir, "--set", "host.warm_restart=true", "--set", "host.journal_dir=/proc/nope")
        _refused(workdir, result, "host.journal_dir", "/proc/nope")
    finally:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)


# The daemon's build blocks (as on a big L3 directory's index rebuild) until stdin has a line.
SLOW_START = """
import hicached.daemon as d
_open = d.open_l3
def open_l3(*args, **kwargs):
    print("BUILDING", flush=True)
    sys.stdin.readline()
    return _open(*args, **kwargs)
d.open_l3 = open_l3
"""


def test_sighup_and_sigterm_during_a_long_start_are_handled() -> None:
    """Fails before the fix: the handlers were installed after the daemon was built, so the
    SIGHUP (a logrotate, a reload) killed it by its default action, with no cleanup."""
    read, write = os.pipe()
    d = serve_patched(SLOW_START, wait=False, stdin=read)
    os.close(read)
    try:
        poll(lambda: log_lines(d, "BUILDING"), bool, 30.0, "the daemon building")
        d.process.send_signal(signal.SIGHUP)
        d.process.send_signal(signal.SIGTERM)
        os.write(write, b"go\n")  # the build goes on; the signals are handled once it is done
        assert d.process.wait(timeout=60) == 0, d.log[-3000:]
        assert log_lines(d, "stop requested during start")
        assert log_lines(d, "configuration reloaded")
        assert log_lines(d, "flushed pending L3 backups")
        assert socket_files(d.workdir) == []
    finally:
        os.close(write)
        d.stop()


def test_a_socket_path_no_unix_socket_can_take_is_one_line_naming_the_key() -> None:
    """Fails before: a path too long for sun_path was gRPC's bind RuntimeError as a traceback,
    and a socket directory that cannot be made (under /proc) a FileNotFoundError traceback,
    both exit 1."""
    workdir = scratch_dir("hcds")
    try:
        deep = workdir / ("d" * 100) / "d.sock"
        _refused(
            workdir, _serve(workdir, "--socket", str(deep)), "too long for a Unix socket", "server.socket"
        )
        assert not deep.parent.exists(), "nothing made for a path that cannot serve"
        result = _serve(workdir, "--socket", "/proc/hicached-nowhere/d.sock")
        _refused(
            workdir, result, "cannot create the socket directory /proc/hicached-nowhere", "server.socket"
        )
    finally:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)


def test_a_socket_path_at_the_limit_serves_with_its_admin_socket_beside_it() -> None:
    """Fails before: the length check added the worker socket's ``.lane`` to the admin
    socket too and refused a worker socket that fits (its admin.sock fits as well), naming
    ``server.admin_socket``, which nobody had set."""
    workdir = scratch_dir("hcds")
    try:
        deep = workdir / ("d" * (92 - len(os.fsencode(str(workdir))) - 1))  # a 92-byte directory
        deep.mkdir()
        assert len(os.fsencode(str(deep))) == 92
        # d.sock + ".lane": 104 bytes; admin.sock: 103 (its private name, 99 + the pid's digits)
        d = launch(
            "--l3",
            "none",
            "--host-budget",
            "64MiB",
            workdir=workdir,
            socket=deep / "d.sock",
            owns_workdir=False,
        )
        try:
            with HiCacheClient(d.admin_target) as admin:
                assert admin.get_stats().version
        finally:
            d.stop()
    finally:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
