"""``hicached serve`` as a user runs it: a subprocess of ``python -m hicached`` started in a
fresh working directory with a TOML file, no ``HICACHED_*`` variables inherited, its
output captured; readiness is the gRPC health service reporting SERVING.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hicached.testing.daemon import Daemon, launch, scratch_dir

__all__ = ["Served", "clean_env", "hicached", "serve"]


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


class Served(Daemon):
    """A running ``hicached serve`` (:func:`serve`): ``stop()`` returns its exit status and
    leaves its log (in the test's directory) to read; ``cleanup()`` also removes its socket
    directory."""

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.socket.parent, ignore_errors=True)


def serve(
    cwd: Path, config_text: str, *extra: str, env: dict[str, str] | None = None, timeout_s: float = 90.0
) -> Served:
    """``hicached serve --config hicached.toml`` (written from ``config_text`` in ``cwd``), with
    a short socket path and a unique shm prefix as flags, waited for until SERVING; its
    output goes to ``cwd/serve-N.log`` (N counts the starts in ``cwd``)."""
    (cwd / "hicached.toml").write_text(config_text)
    log_name = f"serve-{len(list(cwd.glob('serve-*.log')))}.log"
    sockdir = scratch_dir("hca")  # AF_UNIX paths are short
    try:
        d = launch(
            "--config", "hicached.toml", *extra,
            workdir=cwd, socket=sockdir / "d.sock", log_name=log_name,
            env=clean_env(env), clean_env=False, timeout_s=timeout_s,
        )  # fmt: skip
    except BaseException:
        shutil.rmtree(sockdir, ignore_errors=True)
        raise
    return Served(d.target, d.process, d.workdir, d.shm_prefix, d.log_path, owns_workdir=False)
