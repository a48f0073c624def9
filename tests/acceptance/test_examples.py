"""Every ``examples/`` script and every Python block of the docs runs, twice in a row, against
a daemon started with ``hicached serve`` in a fresh directory, checking what it did and
leaving nothing in /dev/shm. (Before this, the README example failed on its second run with
FileExistsError: it never removed its shared-memory pool.)

A doc block that cannot run on its own starts with ``# not run: <why>``; that stays rare."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.served import ROOT, Served, run_twice, served

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
DOCS = [ROOT / "README.md", ROOT / "clients" / "python" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "# not run:"
# The examples that assert what they did and print "verified: ..." lines.
SELF_CHECKING = {
    "sync_worker.py",
    "async_worker.py",
    "two_workers.py",
    "tcp_token_client.py",
    "reattach_after_restart.py",
    "hf_prefix_cache.py",
}


def python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for doc in DOCS:
        for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M), 1):
            blocks.append((f"{doc.relative_to(ROOT)}#{i}", code))
    return blocks


BLOCKS = python_blocks()
RUNNABLE = [(name, code) for name, code in BLOCKS if not code.startswith(NOT_RUN)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with served(tmp_path_factory.mktemp("served")) as d:
        yield d


def test_the_examples_the_readme_promises_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert names >= SELF_CHECKING
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in SELF_CHECKING), "the README lists the examples"


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_twice_and_says_what_it_verified(script: Path, daemon: Served, tmp_path: Path) -> None:
    outputs = run_twice([sys.executable, str(script)], tmp_path, daemon.env(), timeout_s=240)
    if script.name in SELF_CHECKING:
        for out in outputs:
            assert "verified:" in out, out


def test_blocks_that_do_not_run_are_rare_and_say_why() -> None:
    skipped = [(name, code.splitlines()[0]) for name, code in BLOCKS if code.startswith(NOT_RUN)]
    assert len(RUNNABLE) >= 3
    assert len(skipped) <= 2, skipped
    for name, first in skipped:
        assert len(first.removeprefix(NOT_RUN).strip()) >= 20, f"{name}: say why it does not run"


@pytest.mark.parametrize(("name", "code"), RUNNABLE, ids=[name for name, _ in RUNNABLE])
def test_doc_block_runs_twice(name: str, code: str, daemon: Served, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    run_twice([sys.executable, str(script)], tmp_path, daemon.env())


def test_the_hf_example_names_an_install_that_provides_what_it_imports() -> None:
    """Before: `pip install ./clients/python .` (the README's install) had no transformers, and
    no extra provided it; the example ran only in the dev environment. Its install line now
    names the client's `hf` extra, which pins the transformers the tests run with."""
    import tomllib

    client = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())
    daemon = tomllib.loads((ROOT / "pyproject.toml").read_text())
    hf = client["project"]["optional-dependencies"]["hf"]
    pin = next(d for d in daemon["project"]["optional-dependencies"]["dev"] if d.startswith("transformers"))
    assert pin in hf and any(d.startswith("torch") for d in hf)
    assert "pip install './clients/python[hf]'" in (ROOT / "examples/hf_prefix_cache.py").read_text()


def test_every_example_starts_its_daemon_where_the_example_looks() -> None:
    """Before (a review of stop 47): hf_prefix_cache.py said ``hicached serve --socket
    /tmp/hicached.sock``, which the daemon refuses (a socket in a directory others may write)
    and where the example does not look by default. The examples run above against a daemon
    on ``$HICACHED_SOCKET``: each daemon they show is started there."""
    shown = [
        (p.name, line.strip())
        for p in EXAMPLES
        for line in p.read_text().splitlines()
        if line.strip().startswith("hicached serve")
    ]
    assert shown, "the examples show how to start a daemon"
    for name, line in shown:
        assert line.startswith('hicached serve --socket "$HICACHED_SOCKET"'), (name, line)
