"""The command line as a user meets it: help without internals, no tracebacks for expected
failures (a daemon that is not running, a reader that went away), and ``hicached lookup``
answering which tiers hold a prefix a worker published."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hicached_client import HiCacheClient, TokenChain, Transfer, WorkerIdentity, pool_spec, vocab
from hicached_client.export import ShmKVPool

from hicached.testing.daemon import launch, scratch_dir
from tests.acceptance.served import ROOT, Served, served

HICACHED = [sys.executable, "-m", "hicached"]
# The layout examples/sync_worker.py attaches with, and the prefix it publishes.
LAYOUT = [
    "--model",
    "example-model",
    "--page-size",
    "16",
    "--layers",
    "2",
    "--heads",
    "4",
    "--head-dim",
    "64",
]
PREFIX = ",".join(str(t) for t in range(7000, 7000 + 48))


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HICACHED, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with served(tmp_path_factory.mktemp("served")) as d:
        yield d


def test_status_against_a_dead_socket_says_how_to_start_the_daemon(tmp_path: Path) -> None:
    """Before: an UNAVAILABLE line with gRPC's connect error and no hint."""
    sock = tmp_path / "nobody.sock"
    for extra in ((), ("--health-only",)):
        result = cli("status", "--socket", str(sock), "--timeout", "2", *extra, cwd=tmp_path)
        assert result.returncode == 1
        assert f"no daemon is answering at {sock}" in result.stderr
        assert f"hicached serve --socket {sock}" in result.stderr
        assert "Traceback" not in result.stderr


def test_the_hint_for_a_missing_admin_socket_starts_a_daemon_that_serves_it(tmp_path: Path) -> None:
    """Fails before (a review of stop 46): with no daemon, `hicached status` (whose default is
    the admin socket) said to start one with `hicached serve --socket .../admin.sock`, which
    refuses to start (the admin socket must differ from the worker socket). The hint names the
    worker socket beside it; a daemon started so answers on that admin socket."""
    sockdir = scratch_dir("hch")  # AF_UNIX paths are limited to ~107 bytes
    worker, admin = sockdir / "hicached.sock", sockdir / "admin.sock"
    try:
        result = cli("status", "--socket", str(admin), "--timeout", "2", cwd=tmp_path)
        assert result.returncode == 1 and f"no daemon is answering at {admin}" in result.stderr, result.stderr
        assert f"hicached serve --socket {worker}`" in result.stderr, result.stderr
        (tmp_path / "d").mkdir()
        d = launch("--host-budget", "256MiB", "--l3", "none", workdir=tmp_path / "d", socket=worker)
        try:
            assert cli("status", "--socket", str(admin), "--timeout", "10", cwd=tmp_path).returncode == 0
        finally:
            d.stop()
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "1e10"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_a_usage_error(
    timeout: str, tmp_path: Path
) -> None:
    """Before: 0 and -1 ended in a ValueError traceback from the client (exit 1); nan, inf and
    1e10 s failed every call at once with DEADLINE_EXCEEDED."""
    sock = str(tmp_path / "nobody.sock")
    for command in (["status"], ["status", "--health-only"], ["lookup", *LAYOUT, "--tokens", PREFIX]):
        result = cli(*command, "--socket", sock, "--timeout", timeout, cwd=tmp_path)
        assert result.returncode == 2, (command, result.stderr)
        assert "usage: hicached" in result.stderr and "argument --timeout" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "DEADLINE_EXCEEDED" not in result.stderr, result.stderr


# Runs the command line in-process, then says whether it imported torch.
TORCH_PROBE = """
import sys
from hicached import cli
try:
    cli.main(sys.argv[1:])
except SystemExit:
    pass
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "command",
    [
        ["--version"],
        ["--help"],
        ["config", "show"],
        ["keys", "--page-size", "2", "--tokens", "1,2,3,4"],
        ["status", "--socket", "nobody.sock", "--timeout", "1"],
        ["lookup", *LAYOUT, "--tokens", "1,2", "--socket", "nobody.sock"],
    ],
)
def test_commands_that_need_no_pools_start_without_torch(command: list[str], tmp_path: Path) -> None:
    """Fails before: reading the configuration imported the content index, its host pools and
    torch, 1.3 of the 2.4 s every command took to start (`hicached --version` included)."""
    out = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, *command],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.rstrip().endswith("torch imported: False"), (out.stdout[-2000:], out.stderr[-2000:])


# What the command line hands gRPC, printed by a process that runs it: gRPC reads the variable
# when it starts, so it must be set before anything imports grpc.
PROBE = """
import os, sys
from hicached import cli
assert "grpc" not in sys.modules
try:
    cli.main(["--version"])
except SystemExit:
    pass
print(repr(os.environ.get("GRPC_EXPERIMENTS")))
"""


@pytest.mark.parametrize(("given", "seen"), [(None, "-event_engine_client,-event_engine_listener"), ("", "")])
def test_the_command_line_sets_grpc_experiments_unless_the_operator_did(
    given: str | None, seen: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if given is not None:
        env["GRPC_EXPERIMENTS"] = given
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip().splitlines()[-1] == repr(seen)


@pytest.mark.parametrize(
    "args", [["keys", "--page-size", "1", "--tokens", "1,2,3"], ["config", "show", "--keys"]]
)
def test_a_reader_that_went_away_ends_the_output_quietly(args: list[str], tmp_path: Path) -> None:
    """`hicached keys ... | head -1`: before, a BrokenPipeError traceback and exit 1. The
    reading end is closed before the command writes, so its first write fails every time."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.Popen(
        [*HICACHED, *args], cwd=tmp_path, stdout=write_end, stderr=subprocess.PIPE, text=True
    )
    os.close(write_end)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141  # as a process ended by SIGPIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("command", ["bench", "keys", "lookup", "status"])
def test_help_is_for_users_not_internals(command: str, tmp_path: Path) -> None:
    """Before: `bench --help` and `keys --help` printed the modules' docstrings (``rst``, run(quick))."""
    result = cli(command, "--help", cwd=tmp_path)
    assert result.returncode == 0
    assert "``" not in result.stdout and "run(quick)" not in result.stdout, result.stdout
    assert "usage: hicached " + command in result.stdout


def test_lookup_reports_the_tiers_of_a_published_prefix(daemon: Served, tmp_path: Path) -> None:
    worker = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sync_worker.py")],
        cwd=tmp_path,
        env=daemon.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert worker.returncode == 0, worker.stderr
    env = daemon.env()
    # The whole published prefix, by token ids.
    result = cli("lookup", *LAYOUT, "--tokens", PREFIX, "--json", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert (found["pages"], found["l2_hit_pages"], found["total_hit_pages"]) == (3, 3, 3)
    with HiCacheClient(daemon.admin_target) as admin:  # the group the worker published into
        groups = {g.group for g in admin.get_stats().groups if g.model_name == "example-model"}
    assert found["group"] in groups, (found["group"], groups)
    assert found["tiers"] == ["L2", "L2", "L2"]
    # The same prefix by keys (from `hicached keys`), plus one page nobody wrote: exit 1.
    keys = cli("keys", "--page-size", "16", "--tokens", PREFIX + ",1,2", cwd=tmp_path).stdout.split()
    assert keys[:3] == found["keys"]
    result = cli("lookup", *LAYOUT, "--keys", ",".join(keys), cwd=tmp_path, env=env)
    assert result.returncode == 1, result.stderr
    assert "leading pages in L2 (host memory): 3" in result.stdout
    assert result.stdout.rstrip().endswith("-")


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("dtype", list(vocab.DataType))
def test_lookup_sizes_a_page_as_the_daemon_does(kind: str, dtype: str) -> None:
    """The command sizes a page without torch; the daemon's pools with it (``KVSpec``)."""
    from hicached.commands.lookup import _page_bytes
    from hicached.l2.layout import KVSpec

    args = argparse.Namespace(
        kind=kind, dtype=dtype, layers=3, heads=1 if kind == "mla" else 4, head_dim=64, page_size=16
    )
    spec = KVSpec(kind, getattr(torch, dtype), args.layers, args.heads, args.head_dim, args.page_size)
    assert _page_bytes(args) == spec.page_bytes


def test_lookup_of_an_unknown_layout_creates_nothing(daemon: Served, tmp_path: Path) -> None:
    with HiCacheClient(daemon.admin_target) as admin:  # a worker's GetStats shows no groups
        before = admin.get_stats()
    model = f"nobody-{uuid.uuid4().hex[:6]}"
    args = ["--model", model, "--page-size", "16", "--layers", "2", "--heads", "4", "--head-dim", "64"]
    result = cli("lookup", *args, "--tokens", PREFIX, cwd=tmp_path, env=daemon.env())
    assert result.returncode == 1
    assert "no pool group for this layout" in result.stderr and "Traceback" not in result.stderr
    with HiCacheClient(daemon.admin_target) as admin:
        after = admin.get_stats()
    assert len(after.groups) == len(before.groups) and after.host_used_bytes == before.host_used_bytes
    assert not [s for s in after.sessions if s.identity.model_name == model]


def test_lookup_bad_arguments_exit_2_without_traceback(tmp_path: Path) -> None:
    result = cli("lookup", *LAYOUT, "--tokens", "1,x", "--socket", "/nonexistent.sock", cwd=tmp_path)
    assert result.returncode == 2
    assert "'x' is not a decimal integer" in result.stderr and "Traceback" not in result.stderr
    assert os.path.exists("/nonexistent.sock") is False


def test_lookup_names_the_flag_of_an_mla_layout_with_heads(tmp_path: Path) -> None:
    """Fails before (a review of the docs as a user): the daemon's refusal came back naming
    KVSpec.num_heads, a wire field the user never typed."""
    layout = list(LAYOUT)
    heads = layout.index("--heads")
    layout[heads + 1] = "4"
    result = cli(
        "lookup", *layout, "--kind", "mla", "--tokens", PREFIX, "--socket", "/nonexistent.sock", cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert "--heads must be 1 with --kind mla" in result.stderr and "KVSpec" not in result.stderr


def test_lookup_refuses_token_ids_out_of_range_and_an_empty_prefix(daemon: Served, tmp_path: Path) -> None:
    """Fails before: an id below 0 or past 2**64 - 1 was protobuf's ValueError as a traceback
    (exit 1; `hicached keys` refused the same ids), and no ids at all answered "0 pages asked"."""
    for tokens, said in (
        ("-1,2", "token id -1 is outside [0, 2**64 - 1]"),
        (str(2**64), f"token id {str(2**64)[:32]} is outside"),
        ("", "no token ids or keys given"),
        # Fewer ids than one page (a review of stop 46: "0 pages asked", exit 0).
        ("1,2", "2 token ids make no full page of --page-size"),
    ):
        result = cli("lookup", *LAYOUT, f"--tokens={tokens}", cwd=tmp_path, env=daemon.env())
        assert result.returncode == 2 and said in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_a_relative_socket_path_reaches_the_daemon(daemon: Served) -> None:
    """Fails before: a socket path without a leading ``/`` (as `serve --socket run/d.sock`
    binds it, from its working directory) was taken for host:port: "DNS resolution failed"."""
    where = daemon.socket.parent
    env = daemon.env()
    for given in (f"./{daemon.socket.name}", daemon.socket.name):  # the bare name too
        result = cli("status", "--socket", given, cwd=where, env=env)
        assert result.returncode == 0, result.stderr
        assert f"at unix://{daemon.socket}" in result.stdout
    env["HICACHED_SOCKET"] = daemon.socket.name  # as `serve --socket d.sock` was started
    result = cli("status", "--socket", daemon.socket.name, cwd=where, env=env)
    assert result.returncode == 0, result.stderr


def test_lookup_with_a_tenant_finds_that_tenants_prefix(daemon: Served, tmp_path: Path) -> None:
    """Before: `--tenant` always failed with PERMISSION_DENIED (the command attached without the
    tenant and then asked with it), so no tenant's prefix could be looked up. Its own model, so
    its group is the 8-page one made here: the command asked to join with 16 pages' worth and
    found "no pool group for this layout" (it passed only after the file's earlier tests had
    made a larger group of the shared model)."""
    tenant, tokens = f"team-{uuid.uuid4().hex[:6]}", list(range(9000, 9000 + 48))
    model = f"example-model-{tenant}"
    layout = [model if arg == "example-model" else arg for arg in LAYOUT]
    with (
        ShmKVPool(f"hct-cli-{uuid.uuid4().hex[:8]}", num_layers=2, tokens=4 * 16, heads=4, head_dim=64,
                  dtype=torch.bfloat16) as kv,
        HiCacheClient(daemon.target) as client,
    ):  # fmt: skip
        spec = pool_spec(
            "kv", role="anchor", kind="mha", dtype="bfloat16", page_size=16, num_layers=2, num_heads=4,
            head_dim=64, k_buffers=kv.k_buffers(), v_buffers=kv.v_buffers(),
        )  # fmt: skip
        ident = WorkerIdentity(f"w-{tenant}", generation=1, model_name=model, tenant=tenant)
        with client.attach(ident, [spec]) as session:
            written = session.write([Transfer("kv", [0, 1, 2])], allocate=True)
            assert session.publish(TokenChain(tokens), written.transfers).published_pages == 3
    prefix = ",".join(map(str, tokens))
    result = cli(
        "lookup", *layout, "--tokens", prefix, "--tenant", tenant, "--json", cwd=tmp_path, env=daemon.env()
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tiers"] == ["L2", "L2", "L2"]
    # Another tenant (here: none) does not see it.
    result = cli("lookup", *layout, "--tokens", prefix, "--json", cwd=tmp_path, env=daemon.env())
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["total_hit_pages"] == 0
