"""Issue 5: ``hicached status`` against a live daemon (text, ``--json``, ``--health-only``)
and against a socket nobody serves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hicached_client import HiCacheClient, Session, WorkerIdentity

from hicached.testing.servers import redis_server
from tests.daemon.conftest import new_pools, start_file_daemon
from tests.security.users import run_as_other
from tests.support.daemon import ROOT, Daemon, start_daemon
from tests.support.kv import WorkerPools, transfers
from tests.support.state import poll

MODEL = "m-status"


def hicached(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    return subprocess.run(
        [sys.executable, "-m", "hicached", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def socket_of(daemon: Daemon) -> str:
    """The admin socket: ``hicached status`` lists sessions only to an admin (issue 9)."""
    return daemon.admin_target.removeprefix("unix://")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_file_daemon(tmp_path_factory.mktemp("status") / "l3")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def attached(daemon: Daemon, worker_pools: list[WorkerPools]) -> Iterator[tuple[Session, WorkerIdentity]]:
    tag, pools = new_pools(worker_pools, seed=61)
    identity = WorkerIdentity(tag, generation=3, model_name=MODEL, tp_rank=1, tp_size=2)
    with HiCacheClient(daemon.target, timeout_s=30.0) as client, client.attach(identity, pools.specs()) as s:
        assert s.write(transfers(range(5)), allocate=True).ok  # 5 pages in each of two pools
        yield s, identity


def test_status_shows_the_session_and_its_pools(
    daemon: Daemon, attached: tuple[Session, WorkerIdentity]
) -> None:
    session, identity = attached
    shown = hicached("status", "--socket", socket_of(daemon))
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert f"at {daemon.admin_target}" in out
    assert "sessions (1):" in out and "pool groups (1):" in out
    line = next(ln for ln in out.splitlines() if session.session_id in ln)
    assert identity.instance_id in line and "gen 3" in line and f"model '{MODEL}'" in line
    assert "tp 1/2" in line and "owns 10 pages" in line
    for pool in ("kv", "draft"):
        pool_line = next(ln for ln in out.splitlines() if ln.strip().startswith(pool + " "))
        assert "5/" in pool_line and "pages used" in pool_line, pool_line
    assert "file:" in out, "the file L3 backend is listed"


@pytest.mark.parametrize("where", ["--socket", "--target"])
def test_status_json_parses(daemon: Daemon, attached: tuple[Session, WorkerIdentity], where: str) -> None:
    session, identity = attached
    at = socket_of(daemon) if where == "--socket" else daemon.admin_target  # unix:///path
    shown = hicached("status", where, at, "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    (s,) = data["sessions"]
    assert (s["session_id"], s["owned_pages"]) == (session.session_id, 10)
    assert s["identity"]["instance_id"] == identity.instance_id
    (group,) = data["groups"]
    assert group["model_name"] == MODEL and group["sessions"] == 1
    pools = {p["name"]: p for p in group["pools"]}
    assert set(pools) == {"kv", "draft"}
    assert all(p["total_pages"] - p["free_pages"] == 5 for p in pools.values())
    assert [b["name"] for b in data["backends"]] == ["file"]
    assert data["draining"] is False and data["host_used_bytes"] > 0


def test_health_only_prints_serving(daemon: Daemon) -> None:
    shown = hicached("status", "--socket", socket_of(daemon), "--health-only")
    assert (shown.returncode, shown.stdout.strip()) == (0, "SERVING"), shown.stderr


@pytest.mark.parametrize("flags", [(), ("--health-only",), ("--json",)])
def test_missing_socket_exits_1(tmp_path: Path, flags: tuple[str, ...]) -> None:
    missing = tmp_path / "nobody.sock"
    shown = hicached("status", "--socket", str(missing), "--timeout", "1", *flags)
    assert shown.returncode == 1
    assert str(missing) in shown.stderr and "no daemon is answering" in shown.stderr
    assert shown.stdout == ""


def test_a_mistyped_socket_in_a_shared_directory_says_nothing_is_there(tmp_path: Path) -> None:
    """Fails before (a review of stop 45): a path in /tmp (mode 1777) that names no socket got
    only the refusal of the directory, which reads as a daemon's misconfiguration."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    missing = shared / "hicached-typo.sock"
    shown = hicached("status", "--socket", str(missing), "--timeout", "1")
    assert shown.returncode == 1 and "PERMISSION_DENIED" in shown.stderr, shown.stderr
    assert f"there is no socket {missing}: check the path" in shown.stderr, shown.stderr


def test_ready_goes_not_serving_while_draining_and_liveness_stays_serving() -> None:
    """The exec probes docs/deploy.md gives for TLS: `--health-only` (liveness) and
    `--health-only --ready` (readiness). Before, only the overall state could be checked, and
    it stays SERVING while draining: a draining pod stayed Ready."""
    fresh = start_daemon()
    try:
        sock = fresh.target.removeprefix("unix://")
        ready = hicached("status", "--socket", sock, "--health-only", "--ready")
        assert (ready.returncode, ready.stdout.strip()) == (0, "SERVING"), ready.stderr
        with HiCacheClient(fresh.admin_target) as admin:
            admin.drain()
        ready = hicached("status", "--socket", sock, "--health-only", "--ready")
        assert (ready.returncode, ready.stdout.strip()) == (1, "NOT_SERVING"), ready.stderr
        alive = hicached("status", "--socket", sock, "--health-only")
        assert (alive.returncode, alive.stdout.strip()) == (0, "SERVING"), alive.stderr
        alone = hicached("status", "--socket", sock, "--ready")
        assert alone.returncode == 2 and "--ready goes with --health-only" in alone.stderr
        # The daemon's own UNAVAILABLE is said as it is, not as "no daemon is answering ...
        # start one" (a review, stop 41).
        layout = ("--model", "m", "--page-size", "4", "--layers", "1", "--heads", "1", "--head-dim", "8")
        refused = hicached("lookup", "--socket", sock, *layout, "--tokens", "1,2,3,4")
        assert refused.returncode == 1, refused.stderr
        assert "UNAVAILABLE" in refused.stderr and "draining" in refused.stderr, refused.stderr
        assert "no daemon is answering" not in refused.stderr, refused.stderr
    finally:
        fresh.stop()


def test_a_socket_this_user_may_not_open_is_said_so(daemon: Daemon) -> None:
    """Another uid's ``hicached status`` on the admin socket (0600, the daemon's uid) was told
    no daemon was answering there and to start one; it is now told the socket is not its to
    open and which one a worker asks."""
    admin = str(Path(socket_of(daemon)).parent / "admin.sock")
    code = "import sys; from hicached.cli import main; sys.exit(main(sys.argv[1:]))"
    shown = run_as_other(code, "status", "--socket", admin, "--timeout", "5")
    assert shown.returncode == 1, shown.stderr
    assert "this user may not open it" in shown.stderr and "worker socket" in shown.stderr, shown.stderr
    assert "no daemon is answering" not in shown.stderr, shown.stderr


def test_socket_help_names_the_admin_socket_status_defaults_to() -> None:
    """Before: ``--socket`` said "default: $HICACHED_SOCKET", but status asks the admin socket
    ($HICACHED_ADMIN_SOCKET, else admin.sock beside the worker socket)."""
    out = hicached("status", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "default: $HICACHED_ADMIN_SOCKET, else admin.sock next to $HICACHED_SOCKET" in text, text


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--tp-rank", "-1"), ("--tp-size", "99999999999"), ("--page-size", "-1"), ("--layers", "0")],
)
def test_an_integer_flag_out_of_range_is_a_usage_error_naming_it(flag: str, value: str) -> None:
    """Before: ``--tp-rank -1`` ended in a ValueError traceback from the wire's conversion and
    ``--page-size -1`` in "Value out of range: -1", naming no flag."""
    layout = {"--page-size": "4", "--layers": "1", "--heads": "1", "--head-dim": "8", flag: value}
    args = [a for pair in layout.items() for a in pair]
    shown = hicached(
        "lookup", "--socket", "/nonexistent/s.sock", "--model", "m", *args, "--tokens", "1,2,3,4"
    )
    assert shown.returncode == 2, shown.stderr
    assert f"argument {flag}: '{value}' is not an integer in" in shown.stderr, shown.stderr
    assert "Traceback" not in shown.stderr


def test_status_shows_an_l3_outage_beside_the_last_figures() -> None:
    """Fails before (a review of stop 45): with its Redis gone, `hicached status` and its JSON
    kept showing the last L3 figures as if current, with nothing saying the backend was down."""
    with redis_server() as redis:
        d = start_daemon(
            "--l3", "redis", "--set", f"l3.redis.host={redis.host}", "--set", f"l3.redis.port={redis.port}",
            "--set", "l3.redis.socket_timeout_s=1", "--set", "l3.redis.retries=0",
        )  # fmt: skip
        try:
            shown = hicached("status", "--socket", socket_of(d), "--json")
            assert shown.returncode == 0, shown.stderr
            (backend,) = json.loads(shown.stdout)["backends"]
            assert backend["name"] == "redis" and backend["error"] == "", backend
            os.kill(redis.pid, signal.SIGKILL)  # the L3 goes away under the daemon

            def status() -> tuple[dict[str, object], str]:
                data = json.loads(hicached("status", "--socket", socket_of(d), "--json").stdout)
                return data["backends"][0], hicached("status", "--socket", socket_of(d)).stdout

            backend, text = poll(status, lambda s: bool(s[0]["error"]), 30, "status showing the outage")
            assert "unreachable" in str(backend["error"]) and int(str(backend["age_ms"])) >= 0, backend
            assert "UNAVAILABLE: redis server at" in text, text
        finally:
            d.stop()
