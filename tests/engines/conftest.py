"""Fixtures of the engine tests: a live daemon, and worker processes that report JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

from tests.support.daemon import ROOT, Daemon


def unique_model() -> str:
    return f"llama-tiny-{uuid.uuid4().hex[:10]}"


def run_hf_worker(daemon: Daemon, scenario: str, model: str, **options: object) -> Any:
    """Run ``tests.engines.hf_worker`` as its own process; its last stdout line is the report."""
    cmd = [
        sys.executable,
        "-m",
        "tests.engines.hf_worker",
        scenario,
        "--target",
        daemon.target,
        "--model",
        model,
    ]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, (
        f"worker {scenario} failed ({done.returncode}):\n{done.stderr[-4000:]}\n--- daemon ---\n{daemon.log}"
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
