"""``hicached serve`` as a user starts it: a subprocess in a fresh directory, nothing but the
public command line, stopped with SIGTERM (and expected to exit 0 and clean up after itself)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hicached.testing.daemon import Daemon, launch, scratch_dir

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


class Served(Daemon):
    """A daemon a user started (:func:`served`)."""

    def env(self) -> dict[str, str]:
        """A user's environment pointing at this daemon ($HICACHED_SOCKET), no other HICACHED_*."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
        env["HICACHED_SOCKET"] = str(self.socket)
        return env


@contextmanager
def served(workdir: Path, *extra: str) -> Iterator[Served]:
    """``python -m hicached serve`` (the ``hicached`` script) with its socket in a short
    scratch directory, its log, L3 and journal in ``workdir``."""
    sockdir = scratch_dir("hca")  # AF_UNIX paths are limited to ~107 bytes
    d = launch(
        "--host-budget", "256MiB",
        "--l3", "file",
        "--l3-path", str(workdir / "l3"),
        "--set", f"host.journal_dir={workdir / 'journal'}",
        *extra,
        workdir=workdir, socket=sockdir / "d.sock", timeout_s=90.0,
    )  # fmt: skip
    daemon = Served(d.target, d.process, d.workdir, d.shm_prefix, d.log_path, owns_workdir=False)
    try:
        yield daemon
    finally:
        code = daemon.terminate(60.0)
        left = list(SHM.glob(f"{daemon.shm_prefix}*"))
        daemon.stop()
        shutil.rmtree(sockdir, ignore_errors=True)
    assert code == 0, f"daemon exited with {code}:\n{daemon.log}"
    assert not left, "a cleanly stopped daemon leaves no host segments"


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
