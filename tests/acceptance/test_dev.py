"""`./dev serve` exactly as the README's quick start says, in a fresh clone, with
``HICACHED_PYTHON`` naming a fresh venv: it installs into that venv, starts, answers
`hicached status` (the venv's script), stops with exit 0 on SIGTERM; a second run finds its
stamp and does not reinstall. (Before issue 11: with a venv, `exec hicached` found the
checkout's `hicached/` directory instead of the daemon, and every start reinstalled, ~12 s.)

The venv is created with ``--system-site-packages``: torch, grpcio and the other
dependencies then come from this machine's Python instead of being downloaded and unpacked
again (minutes, and gigabytes for torch), while hicached and hicached-client themselves are
installed by `./dev` into the venv, from the clone; the test checks they import from there.
For the same reason pip is told, through its own environment settings (as a user's pip.conf
would), not to resolve dependencies again (PIP_NO_DEPS) nor to build the two editable wheels
in an isolated environment (PIP_NO_BUILD_ISOLATION=0: setuptools is already there): 5 s
instead of 20-90 s on a loaded machine. The venv is made ``--without-pip``, so pip and
setuptools are this machine's too (a 3.11 venv's bundled setuptools 65 cannot build the
editable wheels without ``wheel``). ./dev's own pip command line is unchanged.
The clone is `git clone` of this checkout plus its uncommitted changes, so the test runs
what is on disk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.served import ROOT
from tests.support.daemon import wait_serving

INSTALLING = "dev: installing"


def clone_of_this_checkout(dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True, timeout=120)
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--modified", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src, dst = ROOT / rel, dest / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        elif not src.exists():
            dst.unlink(missing_ok=True)  # deleted here, not yet committed
    return dest


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    """(clone, venv python, runtime dir); the runtime dir is short (AF_UNIX path limit)."""
    base = tmp_path_factory.mktemp("dev")
    clone = clone_of_this_checkout(base / "hicached")
    venv = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    runtime = Path("/tmp") / f"hcdev-{uuid.uuid4().hex[:8]}"
    runtime.mkdir(mode=0o700)
    yield clone, venv / "bin" / "python", runtime
    shutil.rmtree(runtime, ignore_errors=True)


def user_env(venv_python: Path, runtime: Path, cache: Path) -> dict[str, str]:
    """A user's shell: nothing of this test run's imports (PYTHONPATH) or HICACHED_* settings;
    the daemon's default socket and L3 land in temp directories through the XDG variables."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("HICACHED_", "XDG_")) and k != "PYTHONPATH"
    }
    env.update(HICACHED_PYTHON=str(venv_python), XDG_RUNTIME_DIR=str(runtime), XDG_CACHE_HOME=str(cache))
    env.update(PIP_NO_DEPS="1", PIP_NO_BUILD_ISOLATION="0")  # see the module docstring
    return env


def serve_status_stop(clone: Path, env: dict[str, str], log_path: Path) -> str:
    """`./dev serve`, then `hicached status` against it, then SIGTERM; returns its output."""
    socket = Path(env["XDG_RUNTIME_DIR"]) / "hicached" / "hicached.sock"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(["./dev", "serve"], cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"unix://{socket}", proc, 180.0)  # the first run installs
        hicached = Path(env["HICACHED_PYTHON"]).parent / "hicached"
        status = subprocess.run(
            [str(hicached), "status"], check=False, env=env, capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stdout + status.stderr + log_path.read_text()
        # `status` talks to the admin socket next to the worker socket, in the same directory.
        assert status.stdout.startswith("hicached ") and f"unix://{socket.parent}/" in status.stdout, (
            status.stdout
        )
        proc.send_signal(signal.SIGTERM)  # ./dev execs the daemon: this pid is the daemon's
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert not socket.exists(), "a cleanly stopped daemon removes its socket"
    return log_path.read_text()


def test_dev_serve_in_a_fresh_venv_twice(checkout: tuple[Path, Path, Path], tmp_path: Path) -> None:
    clone, venv_python, runtime = checkout
    env = user_env(venv_python, runtime, tmp_path / "cache")

    first = serve_status_stop(clone, env, tmp_path / "first.log")
    venv_prefix = str(venv_python.parent.parent)
    assert f"{INSTALLING} hicached and hicached-client into {venv_prefix}" in first, first
    assert "event=started" in first or '"event": "started"' in first, first
    for module in ("hicached", "hicached_client"):
        where = subprocess.run(
            [str(venv_python), "-P", "-c", f"import {module}; print({module}.__file__)"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        assert Path(where).resolve().is_relative_to(clone.resolve()), (module, where)

    second = serve_status_stop(clone, env, tmp_path / "second.log")
    assert INSTALLING not in second, "the second start reinstalled:\n" + second
    assert "event=started" in second or '"event": "started"' in second, second
