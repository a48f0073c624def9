"""A config file that is no regular file, or too big to be one, swapped in for the daemon's
(review: config reload). SIGHUP re-reads it on the event loop: a FIFO there blocked the loop for
good (health checks timed out after 5 s, SIGTERM went unhandled; /tmp/rev_warm/r8_reload_fifo.py)
and ``/dev/zero`` would have grown the daemon's memory without end. Both are refused with a
logged line, the old configuration kept; at start, exit 2 with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hicached.config import ConfigError, resolve, resolver
from hicached.testing.daemon import launch
from hicached.testing.procs import child_env
from tests.support.daemon import ROOT, Daemon, start_daemon
from tests.support.state import poll

TIMEOUT_S = 30.0


def serving(daemon: Daemon) -> bool:
    with grpc.insecure_channel(daemon.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def test_sighup_with_a_fifo_or_a_huge_file_keeps_serving(tmp_path: Path) -> None:
    """Fails before the fix: after the SIGHUP the daemon never logs the refusal (blocked on the
    FIFO's open) and stops answering health checks."""
    config = tmp_path / "hicached.toml"
    config.write_text("[log]\nlevel = 'info'\n")
    daemon = start_daemon("--config", str(config))
    try:
        config.unlink()
        os.mkfifo(config)
        daemon.process.send_signal(signal.SIGHUP)
        poll(lambda: "not a regular file" in daemon.log, bool, TIMEOUT_S, "the FIFO to be refused")
        assert serving(daemon)
        config.unlink()
        config.write_bytes(b"[log]\nlevel = 'info'\n" + b"#" * (2 << 20) + b"\n")
        daemon.process.send_signal(signal.SIGHUP)
        poll(lambda: "larger than" in daemon.log, bool, TIMEOUT_S, "the huge file to be refused")
        assert "Traceback" not in daemon.log, daemon.log[-3000:]
        assert serving(daemon)
        config.write_text("[log]\nlevel = 'debug'\n")  # the old config stayed; a good one still applies
        daemon.process.send_signal(signal.SIGHUP)
        poll(lambda: "log.level" in daemon.log, bool, TIMEOUT_S, "the good reload")
    finally:
        daemon.stop()


def test_start_with_a_fifo_config_not_named_on_the_command_line_exits_2_with_one_line(tmp_path: Path) -> None:
    """A FIFO at ``$HICACHED_CONFIG`` (a deployment's setting, not a pipe the admin named on
    the command line) is refused at once. Fails before the first fix: the start blocks in
    open() (the 30 s timeout)."""
    config = tmp_path / "fifo.toml"
    os.mkfifo(config)
    result = subprocess.run(
        [sys.executable, "-m", "hicached", "serve", "--socket", str(tmp_path / "d.sock"), "--l3", "none"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=30,
        env={**child_env(clean=True), "HICACHED_CONFIG": str(config)},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(config) in lines[0] and "not a regular file" in lines[0], result.stderr


def test_a_pipe_given_as_config_is_read_at_start_and_sighup_keeps_it(tmp_path: Path) -> None:
    """``hicached serve --config <(...)``: the pipe is read at start; a SIGHUP cannot read it
    again and keeps the configuration, with one line, without blocking. Fails before the fix:
    exit 2, "not a regular file" (the launcher's DaemonDied)."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"[host]\nbudget = '200MiB'\n")
        os.close(write_end)
        daemon = launch("--l3", "none", "--config", f"/dev/fd/{read_end}", pass_fds=(read_end,))
    finally:
        os.close(read_end)
    try:
        assert "host_budget_bytes=209715200" in daemon.log, daemon.log[-3000:]
        daemon.process.send_signal(signal.SIGHUP)
        poll(lambda: "came from the pipe" in daemon.log, bool, TIMEOUT_S, "the refused reload")
        lines = [line for line in daemon.log.splitlines() if "came from the pipe" in line]
        assert len(lines) == 1 and f"/dev/fd/{read_end}" in lines[0], daemon.log[-3000:]
        assert serving(daemon)
    finally:
        daemon.stop()


def test_a_fifo_nobody_writes_stops_the_start_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO given with --config that no writer opens does not hang the start: ConfigError
    after resolver.PIPE_READ_S (here 0.2 s)."""
    config = tmp_path / "fifo.toml"
    os.mkfifo(config)
    monkeypatch.setattr(resolver, "PIPE_READ_S", 0.2)
    with pytest.raises(ConfigError, match="not written and closed within"):
        resolve(env={}, file=config, pipe=True)
