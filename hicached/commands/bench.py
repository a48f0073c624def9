"""``hicached bench``: the daemon's figures beside the machine's own limits, in one run.

Each suite is a ``run(quick) -> dict[str, float]`` in ``hicached.bench``; this
command runs the chosen suites, then prints a table of (figure, machine limit,
ratio) or, with ``--json``, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any

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
}
DEFAULT_SUITES = ("daemon", "pools", "l3")

# (daemon figure, machine limit measured in the same run, what the ratio means)
RATIOS: tuple[tuple[str, str, str], ...] = (
    ("write_gbps", "memcpy_gbps", "D2H write of 1,000 x 64 KiB pages vs plain page gather"),
    ("load_gbps", "memcpy_gbps", "H2D load (per-layer stream) vs plain page gather"),
    ("resolve_rtt_us", "echo_rtt_us", "ResolveTransfers round trip vs bare gRPC echo (lower is better)"),
    ("engine_d2h_gbps", "engine_memcpy_gbps", "copy engine D2H (no gRPC) vs plain page gather"),
    ("engine_h2d_gbps", "engine_memcpy_gbps", "copy engine H2D (no gRPC) vs plain page gather"),
    ("pool_create_gbps", "pool_memcpy_gbps", "creating (reserving + prefaulting) a host pool vs a warm copy"),
    ("hicached_set_gbps", "hicachefile_set_gbps", "SGLang batch_set via hicached vs HiCacheFile"),
    ("hicached_get_gbps", "hicachefile_get_gbps", "SGLang batch_get via hicached vs HiCacheFile"),
    ("l3_file_write_gbps", "disk_write_gbps", "L3 file backend write vs raw sequential write"),
    ("l3_file_read_gbps", "disk_read_gbps", "L3 file backend read vs raw sequential read"),
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


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure the daemon beside the machine's limits",
        description=__doc__,
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
    parser.set_defaults(func=run)


def _progress(message: str) -> None:
    if sys.stderr.isatty():
        print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    suites = args.suite or list(DEFAULT_SUITES)
    results: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for i, name in enumerate(suites, 1):
        _progress(f"[{i}/{len(suites)}] {name} ...")
        module = importlib.import_module(SUITES[name])
        t0 = time.perf_counter()
        figures = module.run(args.quick)
        clash = set(figures) & set(results)
        if clash:
            raise RuntimeError(
                f"benchmark suite {name!r} returns figures another suite already did: {sorted(clash)}"
            )
        results.update(figures)
        seconds[name] = time.perf_counter() - t0
    _progress("")
    if args.json:
        print(json.dumps({**{k: _json_value(k, v) for k, v in results.items()}, "suite_seconds": seconds}))
        return 0
    print(f"{'figure':24} {'value':>10}   {'machine limit':24} {'value':>10}  {'ratio':>6}  meaning")
    shown: set[str] = set()
    for fig, limit, meaning in RATIOS:
        if fig in results and limit in results:
            ratio = results[fig] / results[limit] if results[limit] else float("nan")
            print(
                f"{fig:24} {results[fig]:10.3f}   {limit:24} {results[limit]:10.3f}  {ratio:6.2f}  {meaning}"
            )
            shown.update((fig, limit))
    print()
    for key in sorted(set(results) - shown):
        print(f"{key:40} {_json_value(key, results[key])}")
    return 0 if results.get("verified", 1.0) == 1.0 else 1


def _json_value(key: str, value: float) -> float | bool:
    return bool(value) if key == "verified" else round(value, 4)
