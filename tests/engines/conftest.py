"""Fixtures of the engine tests: a live daemon, and worker processes that report JSON."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.daemon import Daemon
from tests.support.zygote import Zygote


def unique_model() -> str:
    return f"llama-tiny-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def hf_workers() -> Iterator[Zygote]:
    """Forks each worker process from one that has imported torch and transformers (~6 s a
    worker otherwise)."""
    zygote = Zygote(["tests.engines.hf_worker"])
    yield zygote
    zygote.close()


def run_hf_worker(workers: Zygote, daemon: Daemon, scenario: str, model: str, **options: object) -> Any:
    """Run ``tests.engines.hf_worker`` as its own process; its last stdout line is the report."""
    argv = [scenario, "--target", daemon.target, "--model", model]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    done = workers.run("tests.engines.hf_worker", argv, timeout_s=180)
    assert done.returncode == 0, (
        f"worker {scenario} failed ({done.returncode}):\n{done.stderr[-4000:]}\n--- daemon ---\n{daemon.log}"
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
