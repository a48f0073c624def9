"""``hicached bench``: the daemon's figures beside the machine's own limits, in one run.

Each suite is a ``run(quick) -> dict[str, float]`` in ``hicached.bench``; this
command runs the chosen suites (a skipped or failing one does not stop the
others), then prints a table of (figure, machine limit, ratio) or, with
``--json``, one JSON object with every figure plus ``skipped``, ``failed`` and
``notes``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from hicached.bench import OPTIONAL_PACKAGES, SuiteSkipped, missing_package
from hicached.commands._common import positive
from hicached.commands._target import seconds

# suite name -> module under hicached.bench (each exposes run(quick) -> dict[str, float])
SUITES: dict[str, str] = {
    "daemon": "hicached.bench.daemon",
    "copy": "hicached.bench.copy",
    "pools": "hicached.bench.pools",
    "l3": "hicached.bench.l3",
    "keyed": "hicached.bench.keyed",
    "l3_remote": "hicached.bench.l3_remote",
    "sglang": "hicached.bench.sglang",
    "engine": "hicached.bench.engine",
    "soak": "hicached.bench.soak",
    "fastlane": "hicached.bench.fastlane",
    "scale": "hicached.bench.scale",
}
DEFAULT_SUITES = ("daemon", "pools", "l3")

# (daemon figure, machine limit measured in the same run, what the ratio means)
RATIOS: tuple[tuple[str, str, str], ...] = (
    ("write_gbps", "memcpy_gbps", "D2H write of 1,000 x 64 KiB pages vs plain page gather"),
    ("load_gbps", "memcpy_gbps", "H2D load of the same pages vs plain page gather"),
    ("write_gbps", "memcpy_shm_gbps", "the same write vs the same gather between two /dev/shm segments"),
    ("load_gbps", "memcpy_shm_gbps", "the same load vs the same gather between two /dev/shm segments"),
    ("write_gbps", "memcpy_layout_gbps", "the same write vs the same pages gathered in the pool's layout"),
    ("load_gbps", "memcpy_layout_gbps", "the same load vs the same pages gathered in the pool's layout"),
    ("fastlane_write_gbps", "memcpy_gbps", "the same write over the fast lane vs plain page gather"),
    ("fastlane_load_gbps", "memcpy_gbps", "the same load over the fast lane vs plain page gather"),
    ("fastlane_write_gbps", "memcpy_layout_gbps", "the fast-lane write vs the pool-layout gather"),
    ("fastlane_load_gbps", "memcpy_layout_gbps", "the fast-lane load vs the pool-layout gather"),
    ("resolve_rtt_us", "echo_rtt_us", "ResolveTransfers round trip vs bare gRPC echo (lower is better)"),
    ("fastlane_ping_us", "uds_pingpong_us", "fast-lane round trip, no work in the daemon, vs raw ping-pong"),
    ("fastlane_ping_spin_us", "uds_pingpong_us", "the same, the worker spinning up to 50 us before sleeping"),
    (
        "fastlane_rtt_us",
        "uds_pingpong_us",
        "fast-lane Write of 1 page vs raw Unix-socket ping-pong (target <= 2)",
    ),
    ("fastlane_rtt_spin_us", "uds_pingpong_us", "the same Write, the worker spinning up to 50 us"),
    ("grpc_write_rtt_us", "uds_pingpong_us", "the same Write over gRPC vs raw Unix-socket ping-pong"),
    ("fastlane_resolve_rtt_us", "uds_pingpong_us", "fast-lane ResolveTransfers (8 pages) vs ping-pong"),
    ("engine_d2h_gbps", "engine_memcpy_gbps", "copy engine D2H (no gRPC) vs plain page gather"),
    ("engine_h2d_gbps", "engine_memcpy_gbps", "copy engine H2D (no gRPC) vs plain page gather"),
    ("pool_create_gbps", "pool_memcpy_gbps", "creating (reserving + prefaulting) a host pool vs a warm copy"),
    *(
        (f"sglang_{fig}_gbps{sfx}", f"sglang_{lim}_gbps{sfx}", f"SGLang {page}: {what} (target {target})")
        for sfx, page, set_target in (("", "64 KiB", ">= 3"), ("_1m", "1 MiB", ">= 2"))
        for fig, lim, what, target in (
            ("hicached_set", "file_set", "set until in L3, hicached vs HiCacheFile", set_target),
            ("hicached_cold_get", "file_cold_get", "cold get vs HiCacheFile cold get", ">= 2"),
            ("hicached_cold_get", "disk_cold_read", "cold get vs raw disk cold read", ">= 0.7"),
            ("hicached_warm_get", "file_hot_get", "warm get (L2) vs HiCacheFile page-cache get", ">= 3"),
        )
    ),
    ("l3_file_write_gbps", "disk_write_gbps", "L3 file backend write vs raw sequential write"),
    ("l3_file_read_gbps", "disk_read_gbps", "L3 file backend read vs raw sequential read"),
    ("l3_restore_gbps", "disk_read_gbps", "cold prefix restore, L3 -> L2 -> worker, vs raw sequential read"),
    ("key_put_gbps", "redis_set_gbps", "keyed PutPages through the daemon vs redis-py pipelined SET"),
    ("key_get_gbps", "redis_get_gbps", "keyed GetPages through the daemon vs redis-py pipelined GET"),
    ("s3_put_gbps", "s3_raw_put_gbps", "s3 backend PUT vs bare boto3 (same threads)"),
    ("mooncake_put_gbps", "mooncake_raw_put_gbps", "mooncake backend put vs bare Mooncake client"),
    ("mooncake_get_gbps", "mooncake_raw_get_gbps", "mooncake backend get vs bare Mooncake client"),
    (
        "engine_ttft_l2_hit_ms",
        "engine_ttft_prefill_ms",
        "TTFT, prompt prefix from L2 vs full prefill (lower is better)",
    ),
    (
        "engine_ttft_l3_hit_ms",
        "engine_ttft_prefill_ms",
        "TTFT, prefix from L3 after a restart vs full prefill (lower)",
    ),
)
# Every suite names its own baseline; a key two suites both return would overwrite one.


DESCRIPTION = """\
Measure the daemon beside the machine's own limits, in one run: each figure is printed next
to the limit measured the same way on the same machine, with their ratio.

Suites: daemon (a real daemon process: D2H/H2D pages, RPC round trips, keyed pages), copy (the
copy engine without gRPC), pools (host pool creation and page copies), l3 (file backend vs raw
disk; redis vs redis-py when redis-server and the redis extra are installed), keyed (the
content index and L3 paths), l3_remote (S3 via SeaweedFS, Mooncake), sglang (SGLang's storage
calls through the daemon vs HiCacheFile and the raw disk: set, cold get, warm get), soak (N worker processes of mixed operations for a
given time: p50/p99 per operation in the first and last window, daemon RSS and fds over time,
page accounting after every worker detached; not in the default set), fastlane (the shared-memory
fast lane's round trip and per-layer signal vs a raw Unix-socket ping-pong and gRPC), scale (per-page, per-key, per-pool and per-worker cost
as the work grows, plus the raw Unix-socket ping-pong), engine (time to first token of a small
transformers model whose prompt prefix is served from the daemon, from L2 and from L3 after a
restart, vs a full prefill; needs the hf extra). A suite or part whose packages or servers are missing
is skipped with the reason; a failing suite is reported and the others still run (exit 1).
"""


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure the daemon beside the machine's limits",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes; under a minute on 2 cores")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--suite",
        action="append",
        choices=sorted(SUITES),
        help=f"suites to run (repeatable; default: {', '.join(DEFAULT_SUITES)})",
    )
    parser.add_argument(
        "--soak-workers", type=positive, default=None, help="soak: worker processes (default 8)"
    )
    parser.add_argument(
        "--soak-seconds",
        type=seconds,
        default=None,
        help="soak: seconds of mixed operations (default 600; 20 with --quick)",
    )
    parser.add_argument(
        "--sglang-pages",
        type=positive,
        default=None,
        help="sglang: 64 KiB pages per round (default 2048; 256 quick)",
    )
    parser.add_argument(
        "--sglang-pages-1m",
        type=positive,
        default=None,
        help="sglang: 1 MiB pages per round (default 512; 64 quick)",
    )
    parser.add_argument(
        "--sglang-rounds", type=positive, default=None, help="sglang: rounds (default 3; 1 quick)"
    )
    parser.set_defaults(func=run)


def _progress(message: str) -> None:
    if sys.stderr.isatty():
        print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)


class _Notes(logging.Handler):
    """Collects the WARNINGs suites log for the parts they leave out (shown after the table)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name.rsplit('.', 1)[-1]}: {record.getMessage()}")


@dataclass
class _Outcome:
    results: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def _run_suite(name: str, quick: bool, out: _Outcome, options: dict[str, Any]) -> None:
    """Run one suite into ``out``: its figures, or why it was skipped, or how it failed.
    ``options`` are the suite's own keyword arguments (the soak's workers and seconds)."""
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(SUITES[name])
        figures: dict[str, float] = module.run(quick, **options)
    except SuiteSkipped as exc:
        out.skipped[name] = str(exc)
        return
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root not in OPTIONAL_PACKAGES:
            out.failed[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
            return
        out.skipped[name] = missing_package(root) or str(exc)
        return
    except Exception as exc:  # a failing suite must not discard the others' figures
        out.failed[name] = f"{type(exc).__name__}: {exc}"
        print(f"\nhicached bench: suite {name!r} failed:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return
    clash = set(figures) & set(out.results)
    if clash:
        out.failed[name] = f"returns figures another suite already did: {sorted(clash)}"
        return
    out.results.update(figures)
    out.seconds[name] = time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    suites = args.suite or list(DEFAULT_SUITES)
    suite_options = {
        "soak": {"workers": args.soak_workers, "seconds": args.soak_seconds},
        "sglang": {
            "pages": args.sglang_pages,
            "pages_1m": args.sglang_pages_1m,
            "rounds": args.sglang_rounds,
        },
    }
    out = _Outcome()
    notes = _Notes()
    bench_log = logging.getLogger("hicached.bench")
    bench_log.addHandler(notes)
    bench_log.propagate = False  # shown once, as notes, instead of on stderr mid-table
    try:
        for i, name in enumerate(suites, 1):
            _progress(f"[{i}/{len(suites)}] {name} ...")
            _run_suite(name, args.quick, out, suite_options.get(name, {}))
    finally:
        bench_log.removeHandler(notes)
        bench_log.propagate = True
    _progress("")
    results = out.results
    ok = not out.failed and results.get("verified", 1.0) == 1.0
    if args.json:
        print(
            json.dumps(
                {
                    **{k: _json_value(k, v) for k, v in results.items()},
                    "suite_seconds": out.seconds,
                    "skipped": out.skipped,
                    "failed": out.failed,
                    "notes": notes.messages,
                }
            )
        )
        return 0 if ok else 1
    print(f"{'figure':33} {'value':>10}   {'machine limit':31} {'value':>10}  {'ratio':>6}  meaning")
    shown: set[str] = set()
    for fig, limit, meaning in RATIOS:
        if fig in results and limit in results:
            ratio = results[fig] / results[limit] if results[limit] else float("nan")
            print(
                f"{fig:33} {results[fig]:10.3f}   {limit:31} {results[limit]:10.3f}  {ratio:6.2f}  {meaning}"
            )
            shown.update((fig, limit))
    print()
    shown.update(_print_scale_table(results))
    for key in sorted(set(results) - shown):
        print(f"{key:40} {_json_value(key, results[key])}")
    for name, reason in out.skipped.items():
        print(f"skipped suite {name}: {reason}")
    for message in notes.messages:
        print(f"note: {message}")
    for name, error in out.failed.items():
        print(f"FAILED suite {name}: {error}")
    return 0 if ok else 1


def _print_scale_table(results: dict[str, float]) -> set[str]:
    """The ``scale`` suite's figures as one row per measure, one column per size; the keys shown."""
    rows: dict[str, list[tuple[str, str]]] = {}
    for key in results:
        if key.startswith("scale_"):
            row, _, size = key.rpartition("_")
            rows.setdefault(row, []).append((size, key))
    if not rows:
        return set()
    print("scale table (size: value; flat = the cost does not grow with the size)")
    for row in sorted(rows):
        cells = "  ".join(f"{size}: {results[key]:.4g}" for size, key in rows[row])
        print(f"  {row.removeprefix('scale_'):28} {cells}")
    print()
    return {key for cells in rows.values() for _, key in cells}


def _json_value(key: str, value: float) -> float | bool:
    return bool(value) if key == "verified" else round(value, 4)
