"""docs/first-hour.md exactly as written: its shell blocks, in order, in one bash session
(`set -euo pipefail`), from the root of a fresh clone with a fresh venv first on PATH; twice,
each time in a new clone, venv and XDG directories. Also checks the README's install line is
the one the walkthrough runs.

The venv is ``--system-site-packages`` so that torch, grpcio and the other dependencies are
this machine's (downloading torch per run would take minutes); `pip install ./clients/python .`
itself runs unchanged and installs both packages into the venv, and the test checks the
`hicached` the walkthrough ran is the venv's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.acceptance.served import ROOT, SHM
from tests.acceptance.test_dev import clone_of_this_checkout

DOC = ROOT / "docs" / "first-hour.md"


def ours(prefix: str) -> set[str]:
    """/dev/shm names of the walkthrough's daemons (host.shm_prefix ``prefix``) and of its
    example worker (``hicached-example-<pid>-...``)."""
    return {name for name in os.listdir(SHM) if name.startswith((prefix, "hicached-example-"))}


def shell_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), re.S | re.M)


def test_the_walkthrough_covers_the_first_hour() -> None:
    script = "\n".join(shell_blocks())
    for step in ("pip install ./clients/python .", "hicached serve", "python examples/", "hicached status",
                 "hicached lookup", "hicached bench --quick", "kill -TERM"):  # fmt: skip
        assert step in script, step
    readme = (ROOT / "README.md").read_text()
    assert "pip install ./clients/python ." in readme and "docs/first-hour.md" in readme


@pytest.mark.parametrize("attempt", [1, 2])
def test_first_hour_runs_as_written(attempt: int, tmp_path: Path) -> None:
    clone = clone_of_this_checkout(tmp_path / "hicached")
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120
    )
    prefix = f"hcfh{uuid.uuid4().hex[:8]}"
    runtime = Path("/tmp") / prefix  # short: AF_UNIX path limit
    runtime.mkdir(mode=0o700)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("HICACHED_", "XDG_")) and k != "PYTHONPATH"
    }
    env.update(
        PATH=f"{venv / 'bin'}:{env['PATH']}",
        VIRTUAL_ENV=str(venv),
        XDG_RUNTIME_DIR=str(runtime),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        # Other sessions on this machine run daemons with the default prefix at the same
        # time: a prefix of its own (a user's setting, like the XDG ones) makes ours countable.
        HICACHED_HOST_SHM_PREFIX=prefix,
    )
    shm_before = ours(prefix)
    script = "\n".join(shell_blocks())
    try:
        result = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + script],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=540,
            check=False,
        )
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "hicached 0.1.0" in result.stdout  # --version
    assert "event=started" in result.stdout and f"l3_target={tmp_path / 'cache'}" in result.stdout
    assert result.stdout.count("verified:") >= 3
    assert "leading pages in L2 (host memory): 3" in result.stdout
    assert "ratio" in result.stdout  # the bench table
    assert result.stdout.rstrip().endswith("daemon exited with 0")
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-P", "-c", "import hicached; print(hicached.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv), f"hicached imported from {where}, not the venv"
    assert ours(prefix) - shm_before == set(), "the walkthrough left shared memory behind"
