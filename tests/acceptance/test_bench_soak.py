"""``hicached bench --suite soak``: worker processes of mixed operations against a real daemon.
Checks the report's shape and the page accounting after every worker detached, never timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

OPS = (
    "write",
    "load",
    "free",
    "alloc",
    "retract_backup",
    "retract_restore",
    "put_pages",
    "get_pages",
    "lookup",
)


def test_a_short_soak_reports_latencies_daemon_resources_and_leaves_no_page_leaked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    args = ["--suite", "soak", "--soak-workers", "2", "--soak-seconds", "4"]
    result = subprocess.run(
        [sys.executable, "-m", "hicached", "bench", "--quick", "--json", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["failed"] == {} and out["skipped"] == {}, out
    assert out["soak_workers"] == 2 and out["soak_seconds"] == 4
    assert out["soak_ops"] > 0 and out["soak_errors"] == 0, out["notes"]
    for op in OPS:  # every operation of the mix ran in the first window (a fifth of a short run)
        assert out[f"soak_{op}_first_p99_ms"] >= out[f"soak_{op}_first_p50_ms"] > 0, op
    assert any(key.endswith("_last_p50_ms") for key in out)
    for series in ("soak_daemon_rss_mib", "soak_daemon_fds"):
        points = [out[f"{series}_at_{pct}pct"] for pct in (0, 25, 50, 75, 100)]
        assert all(p > 0 for p in points) and out[f"{series}_max"] >= max(points), series
    # After every worker detached: each host page is free or owned by the content index.
    assert out["soak_sessions_left"] == 0 and out["soak_backups_left"] == 0
    assert out["soak_host_pages_total"] > 0
    assert out["soak_host_pages_free"] + out["soak_host_pages_indexed"] == out["soak_host_pages_total"]
    assert out["soak_host_pages_leaked"] == 0
