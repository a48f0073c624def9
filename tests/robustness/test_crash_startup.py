"""Startup and reload faults: a corrupt warm-restart journal starts its group cold; a config file
that is not UTF-8 or is nested too deeply is refused on SIGHUP (old config kept, daemon serving)
and at start (exit 2, one line naming the file). Real daemon subprocesses."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hicached_client import HiCacheClient, WorkerIdentity

from tests.support.daemon import ROOT, Daemon, start_daemon
from tests.support.kv import WorkerPools, transfers, unique_tag
from tests.support.state import poll

TIMEOUT_S = 30.0
NOT_UTF8 = b"[log]\nlevel = 'info'\n# \xff\xfe not utf-8\n"
DEEP = b"[log]\nlevel = 'info'\n[server]\nx = " + b"[" * 50_000 + b"]" * 50_000 + b"\n"

CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "invalid UTF-8": lambda good: b"\xff\xfe" + good,
    "deeply nested JSON": lambda good: b"[" * 100_000 + b"]" * 100_000,
    "wrong types": lambda good: good.replace(b'"pools":', b'"pools":7,"was":', 1),
}


def serving(daemon: Daemon) -> bool:
    with grpc.insecure_channel(daemon.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def test_corrupt_journal_starts_the_group_cold(tmp_path: Path) -> None:
    """Fails before the fix: an invalid-UTF-8 or deeply nested journal raised out of the journal
    reader (UnicodeDecodeError/RecursionError), so every Attach of the group was INTERNAL forever."""
    prefix = f"hccj{uuid.uuid4().hex[:8]}"
    journal_dir = tmp_path / "journal"
    flags = (
        "--set", "host.warm_restart=true",
        "--set", f"host.journal_dir={journal_dir}",
        "--set", f"host.shm_prefix={prefix}",
    )  # fmt: skip
    pools = WorkerPools.create(unique_tag("journal"))
    ident = WorkerIdentity(unique_tag("w"), generation=1, model_name="m-journal")
    try:
        daemon = start_daemon(*flags)
        try:
            with HiCacheClient(daemon.target, timeout_s=TIMEOUT_S) as client:
                session = client.attach(ident, pools.specs(), heartbeat=False)
                assert session.put_pages(["k0", "k1"], transfers(range(2))).ok
                session.detach()
            daemon.process.send_signal(signal.SIGTERM)
            assert daemon.process.wait(timeout=TIMEOUT_S) == 0, daemon.log
        finally:
            daemon.stop()
        (journal,) = journal_dir.glob(f"{prefix}-*.json")
        good = journal.read_bytes()
        for what, corrupt in CORRUPTIONS.items():
            journal.write_bytes(corrupt(good))
            daemon = start_daemon(*flags)
            try:
                with HiCacheClient(daemon.target, timeout_s=TIMEOUT_S) as client:
                    session = client.attach(ident, pools.specs(), heartbeat=False)
                    assert not session.info.joined_existing_group, what
                    assert session.lookup(["k0", "k1"]).l2_hit_pages == 0, what
                    session.detach()
                assert not journal.exists(), f"{what}: the bad journal must be removed"
                assert "starting it cold" in daemon.log, (what, daemon.log)
                daemon.process.send_signal(signal.SIGTERM)
                assert daemon.process.wait(timeout=TIMEOUT_S) == 0, daemon.log
            finally:
                daemon.stop()
    finally:
        pools.close()
        for seg in Path("/dev/shm").glob(f"{prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()


@pytest.mark.parametrize(
    ("what", "content"), [("not valid UTF-8", NOT_UTF8), ("nested too deeply", DEEP)], ids=["utf8", "deep"]
)
def test_sighup_with_a_bad_config_file_keeps_serving(tmp_path: Path, what: str, content: bytes) -> None:
    """Fails before the fix: the re-read raised UnicodeDecodeError/RecursionError out of the
    SIGHUP handler (an unhandled exception with a traceback) instead of a logged refusal."""
    config = tmp_path / "hicached.toml"
    config.write_text("[log]\nlevel = 'info'\n")
    daemon = start_daemon("--config", str(config))
    try:
        config.write_bytes(content)
        daemon.process.send_signal(signal.SIGHUP)
        poll(lambda: "config reload rejected" in daemon.log, bool, TIMEOUT_S, "the reload to be rejected")
        log = daemon.log
        assert what in log and str(config) in log, log
        assert "Traceback" not in log, log
        assert daemon.process.poll() is None
        assert serving(daemon)
        config.write_text("[log]\nlevel = 'debug'\n")  # the old config stayed; a good one still applies
        daemon.process.send_signal(signal.SIGHUP)
        poll(lambda: "log.level" in daemon.log, bool, TIMEOUT_S, "the good reload")
    finally:
        daemon.stop()


@pytest.mark.parametrize(
    ("what", "content"), [("not valid UTF-8", NOT_UTF8), ("nested too deeply", DEEP)], ids=["utf8", "deep"]
)
def test_start_with_a_bad_config_file_exits_2_with_one_line(
    tmp_path: Path, what: str, content: bytes
) -> None:
    """Fails before the fix: an invalid-UTF-8 config file at start ended in a traceback (exit 1)."""
    config = tmp_path / "bad.toml"
    config.write_bytes(content)
    sock = tmp_path / "d.sock"
    result = subprocess.run(
        [sys.executable, "-m", "hicached", "serve", "--socket", str(sock), "--l3", "none",
         "--config", str(config)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(config) in lines[0] and what in lines[0], lines[0]
    assert not sock.exists()
