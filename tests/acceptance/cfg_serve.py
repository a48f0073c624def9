"""``hicached serve`` as a user runs it: a subprocess of ``python -m hicached`` started in a
fresh working directory with a TOML file, no ``HICACHED_*`` variables inherited, its
output captured; readiness is the gRPC health service reporting SERVING.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.integration.daemon import wait_serving

__all__ = ["Served", "clean_env", "hicached", "serve", "start"]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without any ``HICACHED_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    env.update(extra or {})
    return env


def hicached(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """One ``hicached`` command run to completion in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "hicached", *args],
        cwd=cwd,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@dataclass
class Served:
    """A running ``hicached serve``; ``stop()`` sends SIGTERM and returns the exit status."""

    process: subprocess.Popen[bytes]
    socket: Path
    log_path: Path
    shm_prefix: str

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return int(self.process.returncode)

    def cleanup(self) -> None:
        self.stop()
        for seg in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
        shutil.rmtree(self.socket.parent, ignore_errors=True)


def start(
    cwd: Path, config_text: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Write ``hicached.toml`` in ``cwd`` and start ``hicached serve --config hicached.toml``
    (not waited for); stdout+stderr go to ``cwd/serve-N.log``."""
    (cwd / "hicached.toml").write_text(config_text)
    n = len(list(cwd.glob("serve-*.log")))
    log = (cwd / f"serve-{n}.log").open("wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "hicached", "serve", "--config", "hicached.toml", *extra],
            cwd=cwd,
            env=clean_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()


def serve(
    cwd: Path, config_text: str, *extra: str, env: dict[str, str] | None = None, timeout_s: float = 90.0
) -> Served:
    """``hicached serve`` from ``config_text`` (plus a short socket path and a unique shm
    prefix appended as flags), waited for until SERVING."""
    sockdir = Path("/tmp") / f"hca-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # AF_UNIX paths are short
    sockdir.mkdir()
    prefix = f"hca{uuid.uuid4().hex[:10]}"
    flags = ("--socket", str(sockdir / "d.sock"), "--set", f"host.shm_prefix={prefix}", *extra)
    process = start(cwd, config_text, *flags, env=env)
    n = len(list(cwd.glob("serve-*.log"))) - 1
    served = Served(process, sockdir / "d.sock", cwd / f"serve-{n}.log", prefix)
    try:
        wait_serving(served.target, process, timeout_s)
    except BaseException as exc:
        text = served.log
        served.cleanup()
        raise RuntimeError(f"{exc}\n--- hicached serve output ---\n{text}") from exc
    return served
