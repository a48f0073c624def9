"""``hicached bench`` on an install without the optional extras: suites and parts whose
packages are missing are skipped with the reason, a failing suite does not discard the
others, and a daemon that dies is reported with its log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HIDDEN = ("redis", "hiredis", "boto3", "botocore", "mooncake", "sglang")


def hide_optional_packages(folder: Path) -> str:
    """A PYTHONPATH entry whose sitecustomize makes the optional packages unimportable
    (``sys.modules[name] = None``: importing raises ModuleNotFoundError), as on an install
    without the extras. Inherited by child processes (the bench's daemon)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        f"import sys\nfor name in {HIDDEN!r}:\n    sys.modules[name] = None\n"
    )
    return str(folder)


def bench(*args: str, cwd: Path, env: dict[str, str]) -> tuple[int, dict[str, object], str]:
    result = subprocess.run(
        [sys.executable, "-m", "hicached", "bench", "--quick", "--json", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    return result.returncode, json.loads(result.stdout), result.stderr


def user_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    paths = [hide_optional_packages(tmp_path / "hide"), *filter(None, env.get("PYTHONPATH", "").split(":"))]
    env["PYTHONPATH"] = ":".join(paths)
    return env


def test_missing_extras_are_skipped_with_the_reason(tmp_path: Path) -> None:
    """Before: the l3 suite crashed with `No module named 'redis'` and nothing was printed."""
    code, out, err = bench("--suite", "l3", "--suite", "sglang", cwd=tmp_path, env=user_env(tmp_path))
    assert code == 0, err
    assert out["l3_file_write_gbps"] > 0 and out["disk_write_gbps"] > 0  # what can run, ran
    assert "redis_set_gbps" not in out
    skipped = out["skipped"]
    assert (
        isinstance(skipped, dict) and "sglang" in skipped and "hicached-client[sglang]" in skipped["sglang"]
    )
    notes = out["notes"]
    assert isinstance(notes, list) and any("redis" in n and "hicached[redis]" in n for n in notes), notes
    assert out["failed"] == {}


def test_a_dead_daemon_is_shown_with_its_log_and_the_other_suites_still_report(tmp_path: Path) -> None:
    """Before: the bench waited 60 s for a daemon that had exited, deleted its log, raised an
    unrelated error and printed no figure of the suites that had finished."""
    env = user_env(tmp_path)
    env["HICACHED_SERVER_GRACE_S"] = "not-a-number"  # the bench's daemon refuses to start (exit 2)
    code, out, err = bench("--suite", "daemon", "--suite", "l3", cwd=tmp_path, env=env)
    assert code == 1
    failed = out["failed"]
    assert isinstance(failed, dict) and set(failed) == {"daemon"}
    assert "exited with code 2 before it was ready" in failed["daemon"]
    assert "server.grace_s" in err  # the end of the daemon's log, shown
    assert out["l3_file_read_gbps"] > 0  # the l3 suite's figures are kept


def test_the_daemon_suite_leaves_out_the_lane_figures_when_the_lane_is_off(tmp_path: Path) -> None:
    """A user's settings apply to the bench's daemon: with server.fast_lane off, the gRPC figures
    are measured and the lane's are left out with a note saying why (not a failed suite)."""
    env = user_env(tmp_path)
    env["HICACHED_SERVER_FAST_LANE"] = "false"
    code, out, err = bench("--suite", "daemon", cwd=tmp_path, env=env)
    assert code == 0, err
    assert out["failed"] == {} and out["write_gbps"] > 0 and out["verified"] == 1.0
    assert out["memcpy_layout_gbps"] > 0  # the limit in the pool's own layout, beside the others
    assert "fastlane_write_gbps" not in out and "fastlane_load_gbps" not in out
    notes = out["notes"]
    assert isinstance(notes, list) and any("fastlane_write_gbps" in n for n in notes), notes


def test_scale_suite_prints_every_row_of_the_table(tmp_path: Path) -> None:
    """The scale table (issue 13, item 4) has every row at every quick size; shape, not timing."""
    code, out, err = bench("--suite", "scale", cwd=tmp_path, env=user_env(tmp_path))
    assert code == 0, err
    assert out["failed"] == {}
    rows = {
        "scale_write_us_per_page_p": (10, 100, 1000),
        "scale_load_us_per_page_p": (10, 100, 1000),
        "scale_memcpy_us_per_page_p": (10, 100, 1000),
        "scale_lookup_us_per_key_k": (1000, 10000),
        "scale_publish_us_per_key_k": (1000, 10000),
        "scale_pool_create_s_g": ("0.25", "0.5"),
        "scale_pool_alloc_us_g": ("0.25", "0.5"),
        "scale_workers_gbps_w": (1, 2, 4),
        "scale_workers_p99_ms_w": (1, 2, 4),
    }
    for prefix, sizes in rows.items():
        for size in sizes:
            value = out[f"{prefix}{size}"]
            assert isinstance(value, float) and value > 0, (prefix, size, value)


def test_the_help_describes_every_suite_it_offers() -> None:
    """`hicached bench --help` names each suite in its text, not only in the choices (the
    engine suite was offered and never described)."""
    from hicached.commands.bench import SUITES

    result = subprocess.run(
        [sys.executable, "-m", "hicached", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    text = " ".join(result.stdout.split("options:")[0].split())
    assert [s for s in SUITES if f"{s} (" not in text] == []
