"""Start ``worker_kv`` scenarios as real processes and read their JSON reports."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.support.daemon import ROOT, Daemon
from tests.support.kv import unique_tag


def worker_cmd(daemon: Daemon, scenario: str, model: str, tag: str, **options: object) -> list[str]:
    cmd = [sys.executable, "-m", "tests.support.worker_kv", scenario,
           "--target", daemon.target, "--tag", tag, "--model", model]  # fmt: skip
    for key, value in options.items():
        cmd += [f"--{key}", str(value)]
    return cmd


def run_worker(daemon: Daemon, scenario: str, model: str, timeout_s: float = 120.0, **options: object) -> Any:
    """Run a scenario to completion; its last stdout line is the report."""
    tag = unique_tag(scenario)
    done = subprocess.run(
        worker_cmd(daemon, scenario, model, tag, **options),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, (
        f"worker {scenario} failed ({done.returncode}):\n{done.stderr[-4000:]}\n--- daemon ---\n{daemon.log}"
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def spawn_worker(
    daemon: Daemon, scenario: str, model: str, **options: object
) -> tuple[subprocess.Popen[str], str]:
    """Start a long-running scenario with pipes; returns the process and its shm tag."""
    tag = unique_tag(scenario)
    proc = subprocess.Popen(
        worker_cmd(daemon, scenario, model, tag, **options),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, tag


def read_report(proc: subprocess.Popen[str]) -> Any:
    """The next JSON line of a spawned worker (blocks until it is written or the worker dies)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr is not None else ""
        raise AssertionError(f"worker exited ({proc.wait()}) without a report:\n{err[-4000:]}")
    return json.loads(line)
