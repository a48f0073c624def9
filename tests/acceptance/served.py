"""``hicached serve`` as a user starts it: a subprocess in a fresh directory, nothing but the
public command line, stopped with SIGTERM (and expected to exit 0 and clean up after itself)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.integration.daemon import wait_serving

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


@dataclass
class Served:
    target: str
    socket: Path
    workdir: Path
    shm_prefix: str
    process: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        """A user's environment pointing at this daemon ($HICACHED_SOCKET), no other HICACHED_*."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
        env["HICACHED_SOCKET"] = str(self.socket)
        return env

    def log(self) -> str:
        path = self.workdir / "daemon.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


@contextmanager
def served(workdir: Path, *extra: str) -> Iterator[Served]:
    """``python -m hicached serve`` (the ``hicached`` script) on a socket in ``workdir``."""
    # AF_UNIX paths are limited to ~107 bytes: the socket goes in a short directory.
    sockdir = Path("/tmp") / f"hca-{uuid.uuid4().hex[:10]}"
    sockdir.mkdir()
    sock = sockdir / "d.sock"
    prefix = f"hcacc{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable, "-m", "hicached", "serve",
        "--socket", str(sock),
        "--host-budget", "256MiB",
        "--l3", "file",
        "--l3-path", str(workdir / "l3"),
        "--set", f"host.shm_prefix={prefix}",
        "--set", f"host.journal_dir={workdir / 'journal'}",
        *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    with (workdir / "daemon.log").open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env)
    daemon = Served(f"unix://{sock}", sock, workdir, prefix, proc)
    try:
        wait_serving(daemon.target, proc, 90.0)
        yield daemon
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        sock.unlink(missing_ok=True)
        sockdir.rmdir()
    assert proc.returncode == 0, f"daemon exited with {proc.returncode}:\n{daemon.log()}"
    assert not list(SHM.glob(f"{prefix}*")), "a cleanly stopped daemon leaves no host segments"


def shm_left_by(pid: int) -> list[str]:
    """/dev/shm names that carry ``pid`` as a dash-separated part (how the examples and doc
    blocks name their segments: after their main process)."""
    pattern = re.compile(rf"(^|-){pid}(-|$)")
    return sorted(n for n in os.listdir(SHM) if pattern.search(n))


def run_twice(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float = 150) -> list[str]:
    """Run a user program twice in a row; each must exit 0 and leave nothing in /dev/shm.
    Returns each run's stdout."""
    outputs = []
    for attempt in (1, 2):
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        out, err = proc.communicate(timeout=timeout_s)
        assert proc.returncode == 0, f"run {attempt} of {argv[-1]} exited {proc.returncode}:\n{out}\n{err}"
        assert shm_left_by(proc.pid) == [], f"run {attempt} of {argv[-1]} left shared memory behind"
        outputs.append(out)
    return outputs
