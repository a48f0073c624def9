"""A client cannot write lines of its own into the daemon's text log.

On the code before, an attach whose instance_id held a newline and a fake record wrote a
standalone ``<timestamp> CRITICAL hicached.daemon: FORGED ...`` line into the log, and CR
and ANSI escapes in model_name reached it raw. Then the attach line carried both as JSON
string literals (``instance="w1\\n2026-..."``); now such an attach is refused (identity
strings must be printable, tests/security/test_printable_names.py), and a printable one that
looks like a record still stays a quoted value inside the attach line.
"""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity, pool_spec

from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import unique_tag

RECORD = "2026-12-06 02:00:00,000 CRITICAL hicached.daemon: FORGED root password changed event=forged"
MODEL = "m-log\rX\x1b[31mRED\u2028"
FORGED_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} CRITICAL ", re.MULTILINE)


def test_a_forged_identity_stays_inside_the_attach_line(daemon: Daemon) -> None:
    spec = pool_spec("kv", role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1,
                     num_heads=2, head_dim=16, k_buffers=[], host_bytes=1 << 20)  # fmt: skip
    instance = unique_tag("w") + " " + RECORD  # printable: attached, and logged
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        for forged in (
            WorkerIdentity(instance + "\n" + RECORD, 1, "m-log"),
            WorkerIdentity(instance, 1, MODEL),
        ):
            with pytest.raises(HiCacheError) as refused:
                client.attach(forged, [spec], heartbeat=False)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        # the attach line is written before Attach answers, and flushed with it
        client.attach(WorkerIdentity(instance, 1, "m-log"), [spec], heartbeat=False).detach()
    log = daemon.log
    assert not FORGED_RECORD.search(log), log[-3000:]
    assert "\r" not in log and "\x1b" not in log and "\u2028" not in log, ascii(log[-3000:])
    attached = [line for line in log.splitlines() if "session attached" in line]
    assert len(attached) == 1, log[-3000:]
    assert f"instance={json.dumps(instance)} " in attached[0], attached[0]


def test_a_client_looping_on_attach_cannot_flood_the_log() -> None:
    """Each attach and detach writes a line; a loop of them wrote every one (372 KiB/s in a
    review). Now each call site writes at most log.max_rate lines a second after a burst of
    10 s worth, and its next line says how many it dropped: none goes uncounted."""
    rate = 5.0
    d = start_daemon("--set", f"log.max_rate={rate}")
    try:
        spec = pool_spec("kv", role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1,
                         num_heads=2, head_dim=16, k_buffers=[], host_bytes=1 << 20)  # fmt: skip
        tag = unique_tag("flood")
        attaches = 0
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            start = time.monotonic()
            for _ in range(80):
                client.attach(WorkerIdentity(tag, 1, "m-flood"), [spec], heartbeat=False).detach()
                attaches += 1
            elapsed = time.monotonic() - start
            lines = [line for line in d.log.splitlines() if "session attached" in line]
            assert len(lines) <= rate * 10 + rate * elapsed + 1, f"{len(lines)} lines in {elapsed:.2f} s"
            # The next line written (a token back after 1 / rate s) says how many were dropped
            # since the last one: attach until one more line is written.
            written = len(lines)
            deadline = time.monotonic() + 30
            while len(lines) == written:
                assert time.monotonic() < deadline, lines[-1]
                client.attach(WorkerIdentity(tag, 1, "m-flood"), [spec], heartbeat=False).detach()
                attaches += 1
                lines = [line for line in d.log.splitlines() if "session attached" in line]
        dropped = sum(int(m) for m in re.findall(r" dropped=(\d+)", "\n".join(lines)))
        assert len(lines) + dropped == attaches, (len(lines), dropped, attaches)
    finally:
        d.stop()
