"""docs/first-hour.md exactly as written: its shell blocks, in order, in one bash session
(`set -euo pipefail`), from the root of a fresh clone with a fresh venv first on PATH; twice,
each time in a new clone, venv and XDG directories; the two runs go at the same time (as two
users on one machine would: they share nothing but the Python install), which cuts the
wall time of the slowest acceptance test. Also checks the README's install line is
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.acceptance.served import ROOT, SHM
from tests.acceptance.test_dev import clone_of_this_checkout

DOC = ROOT / "docs" / "first-hour.md"


def ours(*prefixes: str) -> set[str]:
    """/dev/shm names of the walkthroughs' daemons (host.shm_prefix one of ``prefixes``) and
    of their example workers (``hicached-example-<pid>-...``)."""
    return {name for name in os.listdir(SHM) if name.startswith((*prefixes, "hicached-example-"))}


def shell_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), re.S | re.M)


def test_the_walkthrough_covers_the_first_hour() -> None:
    script = "\n".join(shell_blocks())
    for step in ("pip install ./clients/python .", "hicached serve", "python examples/", "hicached status",
                 "hicached lookup", "hicached bench --quick", "kill -TERM"):  # fmt: skip
        assert step in script, step
    readme = (ROOT / "README.md").read_text()
    assert "pip install ./clients/python ." in readme and "docs/first-hour.md" in readme


@dataclass
class Walkthrough:
    """One run of the walkthrough: its own clone, venv, XDG directories and shm prefix."""

    base: Path
    venv: Path
    prefix: str
    env: dict[str, str]
    result: subprocess.CompletedProcess[str] | None = None


def prepare(base: Path) -> Walkthrough:
    clone_of_this_checkout(base / "hicached")
    venv = base / "venv"
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
        XDG_CACHE_HOME=str(base / "cache"),
        # Other sessions on this machine run daemons with the default prefix at the same
        # time: a prefix of its own (a user's setting, like the XDG ones) makes ours countable.
        HICACHED_HOST_SHM_PREFIX=prefix,
    )
    return Walkthrough(base, venv, prefix, env)


@pytest.fixture(scope="module")
def walkthroughs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, Walkthrough], set[str]]:
    """Both runs of the walkthrough, each in a fresh clone, venv and XDG directories, run at
    the same time (two users on one machine: nothing is shared but the Python install), to
    completion; and the shared memory of theirs left behind once both ended."""
    bases = [tmp_path_factory.mktemp(f"first-hour-{attempt}") for attempt in (1, 2)]
    with ThreadPoolExecutor(len(bases)) as pool:
        runs = dict(zip((1, 2), pool.map(prepare, bases), strict=True))
    shm_before = ours(*(run.prefix for run in runs.values()))
    script = "set -euo pipefail\n" + "\n".join(shell_blocks())

    def walk(run: Walkthrough) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", script],
            cwd=run.base / "hicached",
            env=run.env,
            capture_output=True,
            text=True,
            timeout=540,
            check=False,
        )

    try:
        with ThreadPoolExecutor(len(runs)) as pool:
            for run, result in zip(runs.values(), pool.map(walk, runs.values()), strict=True):
                run.result = result
    finally:
        for run in runs.values():
            shutil.rmtree(run.env["XDG_RUNTIME_DIR"], ignore_errors=True)
    return runs, ours(*(run.prefix for run in runs.values())) - shm_before


@pytest.mark.parametrize("attempt", [1, 2])
def test_first_hour_runs_as_written(
    attempt: int, walkthroughs: tuple[dict[int, Walkthrough], set[str]]
) -> None:
    runs, shm_left = walkthroughs
    run = runs[attempt]
    result, venv, env = run.result, run.venv, run.env
    assert result is not None
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "hicached 0.1.0" in result.stdout  # --version
    # "PATH (capacity N)" holds spaces: the text log writes it as a JSON string
    assert "event=started" in result.stdout and f'l3_target="{run.base / "cache"}' in result.stdout
    assert result.stdout.count("verified:") >= 3
    assert "leading pages in L2 (host memory): 3" in result.stdout
    assert "ratio" in result.stdout  # the bench table
    assert "memcpy_shm_gbps" in result.stdout  # the daemon suite's limits, private and shared memory
    assert "fastlane_write_gbps" in result.stdout  # and the same pages over the fast lane
    assert result.stdout.rstrip().endswith("daemon exited with 0")
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-P", "-c", "import hicached; print(hicached.__file__)"],
        cwd=run.base,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv), f"hicached imported from {where}, not the venv"
    # A daemon's segments carry its run's prefix; an example's (``hicached-example-<pid>``)
    # cannot be told apart, so a leaked one fails both runs.
    others = tuple(r.prefix for r in runs.values() if r is not run)
    mine = {name for name in shm_left if not name.startswith(others)}
    assert mine == set(), f"the walkthrough left shared memory behind: {sorted(mine)}"
