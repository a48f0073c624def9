"""A real ``hicached serve`` process with a fault injected at a named place.

The child is ``python -c PATCH`` followed by the CLI's own ``main()``: ``patch`` replaces a
function of the daemon (a failing sweep, a lane that cannot be built, a slow start) before
the daemon is built, so the test watches the product react to a fault it cannot be made to
hit from outside. The daemon is otherwise the suite's (no L3, small budget); ``stdin`` lets a
patch block until the test says go. The returned :class:`Daemon` is stopped as any other.
Not thread-safe: one caller drives one daemon.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from hicached.testing.daemon import Daemon, scratch_dir, wait_serving
from hicached.testing.procs import child_env
from tests.support.state import poll

__all__ = ["log_lines", "metrics_port", "serve_patched", "socket_files"]


def serve_patched(
    patch: str,
    *args: str,
    wait: bool = True,
    stdin: int = subprocess.DEVNULL,
    runner: Sequence[str] = (),
    owner: int | None = None,
) -> Daemon:
    """Launch the patched daemon in a new scratch directory; wait until SERVING when ``wait``.

    ``runner`` goes before the interpreter (``setpriv ...`` to run as another uid), and
    ``owner`` then owns the scratch directory (mode 0700, where the daemon binds its sockets).
    """
    workdir = scratch_dir("hcf")
    if owner is not None:
        os.chown(workdir, owner, owner)
        os.chmod(workdir, 0o700)
    sock = workdir / "d.sock"
    prefix = f"hcdf{uuid.uuid4().hex[:8]}"
    code = f"import sys\n{patch}\nfrom hicached.cli import main\nsys.exit(main())\n"
    cmd = [*runner, sys.executable, "-c", code, "serve", "--socket", str(sock), "--l3", "none",
           "--host-budget", "64MiB", "--set", f"host.shm_prefix={prefix}", "--set", "host.prefault=false",
           *args]  # fmt: skip
    log_path = workdir / "daemon.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=stdin, env=child_env(clean=True)
        )
    daemon = Daemon(f"unix://{sock}", process, workdir, prefix, log_path)
    if wait:
        try:
            wait_serving(daemon.target, process, 60.0)
        except BaseException:
            daemon.stop()
            raise
    return daemon


def log_lines(daemon: Daemon, needle: str) -> list[str]:
    return [line for line in daemon.log.splitlines() if needle in line]


def metrics_port(daemon: Daemon) -> int:
    """The port of a daemon started with ``--metrics-port 0`` (from its startup log line)."""
    line = poll(lambda: log_lines(daemon, "metrics on http://"), bool, 30.0, "the metrics line")[0]
    found = re.search(r"metrics on http://[^:]+:(\d+)/metrics", line)
    assert found, line
    return int(found.group(1))


def socket_files(directory: Path) -> list[str]:
    """The sockets left in ``directory`` (the daemon's log is not one)."""
    return sorted(p.name for p in directory.iterdir() if p.is_socket())
