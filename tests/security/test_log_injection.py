"""A client cannot write lines of its own into the daemon's text log.

On the code before, an attach whose instance_id held a newline and a fake record wrote a
standalone ``<timestamp> CRITICAL hicached.daemon: FORGED ...`` line into the log, and CR
and ANSI escapes in model_name reached it raw. Now the attach line carries both as JSON
string literals (``instance="w1\\n2026-..."``) and the log holds only the daemon's records.
"""

from __future__ import annotations

import json
import re

from hicached_client import HiCacheClient, WorkerIdentity, pool_spec

from tests.support.daemon import Daemon
from tests.support.kv import unique_tag

FORGED = "\n2026-12-06 02:00:00,000 CRITICAL hicached.daemon: FORGED root password changed event=forged"
MODEL = "m-log\rX\x1b[31mRED\u2028"
FORGED_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} CRITICAL ", re.MULTILINE)


def test_a_forged_identity_stays_inside_the_attach_line(daemon: Daemon) -> None:
    instance = unique_tag("w") + FORGED
    spec = pool_spec("kv", role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1,
                     num_heads=2, head_dim=16, k_buffers=[], host_bytes=1 << 20)  # fmt: skip
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        # the attach line is written before Attach answers, and flushed with it
        client.attach(WorkerIdentity(instance, 1, MODEL), [spec], heartbeat=False).detach()
    log = daemon.log
    assert not FORGED_RECORD.search(log), log[-3000:]
    assert "\r" not in log and "\x1b" not in log and "\u2028" not in log, ascii(log[-3000:])
    attached = [line for line in log.splitlines() if "session attached" in line]
    assert len(attached) == 1, log[-3000:]
    assert f"instance={json.dumps(instance)} " in attached[0], attached[0]
    assert f"model={json.dumps(MODEL)} " in attached[0], attached[0]
