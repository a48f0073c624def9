"""The command line against a hostile server: whatever answers on the socket (an older daemon
that let a worker name itself with escapes, or a stranger's process posing as the daemon)
cannot drive the admin's terminal.

Each test starts a fake hicached in-process (:class:`Fake`, a plain gRPC server on a Unix
socket) and runs ``python -m hicached`` against it as a user would. On the code before,
``hicached status`` and ``hicached lookup`` printed the server's strings and error details raw:
OSC 0 retitled the window, CSI 2J cleared the screen, OSC 52 wrote the clipboard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc
from hicached_client.v1 import types_pb2 as tpb

from hicached.testing.daemon import scratch_dir
from tests.support.daemon import ROOT

# Window title, screen clear and home, clipboard write (OSC 52), BEL, a C1 CSI, DEL, a bidi override.
EVIL = "\x1b]0;owned\x1b\\\x1b[2J\x1b[H\x1b]52;c;cm0gLXJmIH4K\x07\x9b31m\x7f\u202eend"
# What a terminal obeys: every C0 control but the newline the command writes itself, DEL, C1,
# and the bidi controls (U+202A..U+202E, U+2066..U+2069).
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
LAYOUT = ["--model", "m", "--page-size", "4", "--layers", "1", "--heads", "1", "--head-dim", "8"]


@dataclass
class Answers:
    """What the fake answers; a test sets what it needs before running the command."""

    stats: pb.GetStatsResponse = field(default_factory=pb.GetStatsResponse)
    # (code, details) every HiCacheService call and the health check fail with, if set.
    fail: tuple[grpc.StatusCode, str] | None = None
    attach_fail: tuple[grpc.StatusCode, str] | None = None
    lookup: pb.LookupResponse = field(default_factory=pb.LookupResponse)
    health: int = health_pb2.HealthCheckResponse.SERVING


class _Service(pb_grpc.HiCacheServiceServicer):
    def __init__(self, answers: Answers) -> None:
        self.answers = answers

    def _maybe_fail(self, context: Any, fail: tuple[grpc.StatusCode, str] | None) -> None:
        if fail is not None:
            context.abort(*fail)

    def GetStats(self, request: Any, context: Any) -> pb.GetStatsResponse:
        self._maybe_fail(context, self.answers.fail)
        return self.answers.stats

    def Attach(self, request: Any, context: Any) -> pb.AttachResponse:
        self._maybe_fail(context, self.answers.fail or self.answers.attach_fail)
        return pb.AttachResponse(session_id="s-1", session_secret="secret", lease_ms=30_000, group=EVIL)

    def Lookup(self, request: Any, context: Any) -> pb.LookupResponse:
        return self.answers.lookup

    def Detach(self, request: Any, context: Any) -> pb.DetachResponse:
        return pb.DetachResponse()


class _Health(health_pb2_grpc.HealthServicer):
    def __init__(self, answers: Answers) -> None:
        self.answers = answers

    def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:
        if self.answers.fail is not None:
            context.abort(*self.answers.fail)
        return health_pb2.HealthCheckResponse(status=self.answers.health)  # type: ignore[arg-type]


@dataclass
class Fake:
    socket: Path
    answers: Answers

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``python -m hicached ARGS --socket <the fake>`` as a user runs it."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
        return subprocess.run(
            [sys.executable, "-m", "hicached", *args, "--socket", str(self.socket), "--timeout", "30"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip


@pytest.fixture
def fake() -> Iterator[Fake]:
    where = scratch_dir("hcf")
    answers = Answers()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_send_message_length", 1 << 30)],
    )
    pb_grpc.add_HiCacheServiceServicer_to_server(_Service(answers), server)  # type: ignore[no-untyped-call]
    health_pb2_grpc.add_HealthServicer_to_server(_Health(answers), server)
    server.add_insecure_port(f"unix://{where / 'fake.sock'}")
    server.start()
    try:
        yield Fake(where / "fake.sock", answers)
    finally:
        server.stop(grace=None)
        shutil.rmtree(where, ignore_errors=True)


def hostile_stats() -> pb.GetStatsResponse:
    """Every string ``hicached status`` prints, made of escapes."""
    identity = tpb.WorkerIdentity(instance_id=EVIL, model_name=EVIL, tenant=EVIL)
    return pb.GetStatsResponse(
        version=EVIL,
        sessions=[
            pb.SessionInfo(
                session_id=EVIL,
                identity=identity,
                group=EVIL,
                pools=[pb.SessionPool(name=EVIL, buffers=EVIL, data_path=EVIL)],
            )
        ],
        groups=[pb.GroupInfo(group=EVIL, model_name=EVIL, pools=[tpb.PoolInfo(name=EVIL, segment=EVIL)])],
        backups=[pb.RetractionInfo(backup_id=EVIL, session_id=EVIL, request_id=EVIL)],
        backends=[pb.BackendInfo(name=EVIL)],
    )


def assert_escaped(text: str, times: int) -> None:
    """No character a terminal would obey; the escapes shown as text, ``times`` or more."""
    assert not RAW.search(text), ascii(text)
    assert text.count(r"\x1b]0;owned\x1b\\x1b[2J\x1b[H\x1b]52;") >= times, text


def test_status_escapes_every_string_a_hostile_server_answers(fake: Fake) -> None:
    fake.answers.stats = hostile_stats()
    shown = fake.cli("status")
    assert shown.returncode == 0, shown.stderr
    # version; session id, instance id, model, its pool's name, buffers and data path; group,
    # its model, its pool's name and segment; backup id, request id, session; backend: 15
    assert_escaped(shown.stdout, 15)
    assert "\\u202eend" in shown.stdout and "\\x9b31m\\x7f" in shown.stdout, shown.stdout


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["status"], 1),
        (["status", "--json"], 1),
        (["status", "--health-only"], 1),
        (["lookup", *LAYOUT, "--tokens", "1,2,3,4"], 1),
    ],
)
def test_a_failure_escapes_the_servers_details(fake: Fake, args: list[str], code: int) -> None:
    fake.answers.fail = (grpc.StatusCode.PERMISSION_DENIED, EVIL)
    shown = fake.cli(*args)
    assert shown.returncode == code, shown.stderr
    assert "PERMISSION_DENIED" in shown.stderr and "Traceback" not in shown.stderr, shown.stderr
    assert_escaped(shown.stderr, 1)


def test_lookup_escapes_the_groups_a_hostile_server_lists(fake: Fake) -> None:
    """No group for the layout (Attach NOT_FOUND): lookup lists the model's groups from GetStats."""
    fake.answers.attach_fail = (grpc.StatusCode.NOT_FOUND, EVIL)
    fake.answers.stats = pb.GetStatsResponse(
        groups=[pb.GroupInfo(group=EVIL, model_name="m", pools=[tpb.PoolInfo(name=EVIL, page_size=4)])]
    )
    shown = fake.cli("lookup", *LAYOUT, "--tokens", "1,2,3,4")
    assert shown.returncode == 1, shown.stderr
    assert "no pool group for this layout" in shown.stderr, shown.stderr
    assert_escaped(shown.stderr, 2)


def test_lookup_escapes_the_keys_a_hostile_server_answers(fake: Fake) -> None:
    fake.answers.lookup = pb.LookupResponse(keys=[EVIL, EVIL], l2_hit_pages=2, total_hit_pages=2)
    shown = fake.cli("lookup", *LAYOUT, "--tokens", "1,2,3,4,5,6,7,8")
    assert shown.returncode == 0, shown.stderr
    assert_escaped(shown.stdout, 3)  # the group Attach named (a review of stop 46), the two keys


def test_status_refuses_an_answer_over_16_mib(fake: Fake) -> None:
    """Before: the client accepted 256 MiB; a stranger's 64 MiB answer of tiny sessions took
    `status` 212 s and 4.6 GiB. Now an answer over 16 MiB fails before it is converted."""
    huge = pb.SessionInfo(session_id="s", identity=tpb.WorkerIdentity(instance_id="x" * (17 << 20)))
    fake.answers.stats = pb.GetStatsResponse(version="x", sessions=[huge])
    for args in (["status"], ["status", "--json"]):
        shown = fake.cli(*args)
        assert shown.returncode == 1, shown.stderr[:2000]
        assert "RESOURCE_EXHAUSTED" in shown.stderr and "larger than max" in shown.stderr, shown.stderr
        assert shown.stdout == "", len(shown.stdout)


def test_status_prints_at_most_100_rows_per_table(fake: Fake) -> None:
    pools = [pb.SessionPool(name=f"p{i}") for i in range(40)]
    group_pools = [tpb.PoolInfo(name=f"p{i}") for i in range(40)]
    fake.answers.stats = pb.GetStatsResponse(
        version="x",
        sessions=[pb.SessionInfo(session_id=f"s{i}", pools=pools) for i in range(250)],
        groups=[pb.GroupInfo(group=f"g{i}", pools=group_pools) for i in range(150)],
        backups=[pb.RetractionInfo(backup_id=f"b{i}") for i in range(120)],
    )
    shown = fake.cli("status")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "sessions (250):" in lines and "pool groups (150):" in lines, lines[:5]
    assert sum(line.startswith("  s") for line in lines) == 100
    assert sum(line.startswith("  g") for line in lines) == 100
    assert sum(line.startswith("  b") for line in lines) == 100
    assert sum(line.startswith("    pool p") for line in lines) == 100 * 32  # a session's pools
    assert "  ... and 150 more sessions (--json lists them all)" in lines
    assert "  ... and 50 more pool groups (--json lists them all)" in lines
    assert "  ... and 20 more retraction backups (--json lists them all)" in lines
    assert lines.count("    ... and 8 more pools (--json lists them all)") == 200  # 100 sessions, 100 groups
    assert len(lines) < 7000, len(lines)
    data = json.loads(fake.cli("status", "--json").stdout)
    assert (len(data["sessions"]), len(data["groups"]), len(data["backups"])) == (250, 150, 120)


def test_health_only_names_a_status_it_does_not_know(fake: Fake) -> None:
    """Before: a ValueError traceback (`ServingStatus.Name(99)`). Now the status is named by
    its number and the probe fails (exit 1): only SERVING is healthy."""
    fake.answers.health = 99
    shown = fake.cli("status", "--health-only")
    assert (shown.returncode, shown.stdout.strip()) == (1, "UNKNOWN_STATUS(99)"), shown.stderr
    assert "Traceback" not in shown.stderr, shown.stderr
