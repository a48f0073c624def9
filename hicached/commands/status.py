"""``hicached status``: what a running daemon holds (sessions, pools, L3), or only its health."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hicached_client import HiCacheError, Stats
from hicached_client._channel import (
    ADMIN_SOCKET_ENV,
    ADMIN_SOCKET_NAME,
    SOCKET_ENV,
    default_admin_target,
)
from hicached_client.v1 import hicached_pb2 as pb

from hicached.commands._common import shown
from hicached.commands._target import (
    MAX_ANSWER_BYTES,
    add_target_flags,
    client_of,
    failure_message,
    target_of,
    tcp_credentials,
)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status", help="show a running daemon's sessions, pools and L3 state"
    )
    add_target_flags(
        parser,
        default_help=f"${ADMIN_SOCKET_ENV}, else {ADMIN_SOCKET_NAME} next to ${SOCKET_ENV} or the "
        "daemon's default path: the admin socket, which shows every session",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print one JSON object, every row (the text shows at most {MAX_ROWS} rows per "
        f"table); an answer over {MAX_ANSWER_BYTES >> 20} MiB is refused either way",
    )
    parser.add_argument(
        "--health-only",
        action="store_true",
        help="only check the gRPC health service; exit 0 when SERVING (for probes and HEALTHCHECK)",
    )
    parser.add_argument(
        "--ready",
        action="store_true",
        help="with --health-only: check readiness, the worker service, NOT_SERVING while the "
        "daemon drains (the overall state, the default, stays SERVING: liveness)",
    )
    parser.set_defaults(func=run)


# The service the daemon marks NOT_SERVING while it drains (hicached/server/app.py); the
# deploy manifests' readiness probe checks the same one.
_READY_SERVICE = pb.DESCRIPTOR.services_by_name["HiCacheService"].full_name


def _health(target: str, timeout: float, service: str, credentials: grpc.ChannelCredentials | None) -> int:
    channel = (
        grpc.secure_channel(target, credentials) if credentials is not None else grpc.insecure_channel(target)
    )
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            print(failure_message(target, exc.code(), exc.details() or ""), file=sys.stderr)
            return 1
    try:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except ValueError:  # not in this grpcio's enum: a newer server's, or a hostile one's (exit 1)
        status = f"UNKNOWN_STATUS({reply.status})"
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def run(args: argparse.Namespace) -> int:
    # Default: the admin socket, which shows every session (a worker socket: aggregates only).
    target = target_of(args, default=default_admin_target)
    if args.ready and not args.health_only:
        print("hicached status: --ready goes with --health-only", file=sys.stderr)
        return 2
    if args.health_only:
        _, credentials = tcp_credentials(args, target)  # health answers without a token
        return _health(target, args.timeout, _READY_SERVICE if args.ready else "", credentials)
    try:
        with client_of(args, target) as client:
            stats = client.get_stats()
    except HiCacheError as exc:
        print(failure_message(target, exc.code, exc.message), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_as_json(stats), default=str))
        return 0
    _print_text(stats, target)
    return 0


# Rows printed per table, and pools per session or group (the daemon's default
# limits.max_pools_per_attach); the rest are counted on one line. A terminal of 100 sessions
# is already more than a person reads, and an answer may come from a stranger on the socket
# (up to MAX_ANSWER_BYTES: 1.6 million one-line sessions). --json prints every row.
MAX_ROWS = 100
MAX_POOL_ROWS = 32


def _more(total: int, limit: int, indent: str, what: str) -> None:
    if total > limit:
        print(f"{indent}... and {total - limit} more {what} (--json lists them all)")


def _print_text(stats: Stats, target: str) -> None:
    # Every string of the answer goes through shown(): it is the daemon's, or an impostor's.
    print(f"hicached {shown(stats.version)} at {target}{'  (draining)' if stats.draining else ''}")
    used, budget = stats.host_used_bytes, stats.host_budget_bytes
    print(f"host memory: {used / 2**20:.1f} MiB of {budget / 2**20:.1f} MiB budget")
    print(f"\nsessions ({len(stats.sessions)}):")
    for s in stats.sessions[:MAX_ROWS]:
        w = s.identity
        print(
            f"  {shown(s.session_id)}  {shown(w.instance_id)} gen {w.generation}  model '{shown(w.model_name)}' "
            f"tp {w.tp_rank}/{w.tp_size} pp {w.pp_rank}/{w.pp_size}  owns {s.owned_pages} pages"
        )
        for sp in s.pools[:MAX_POOL_ROWS]:
            path = shown(sp.data_path) or "(not given)"
            print(f"    pool {shown(sp.name)}: buffers {shown(sp.buffers)}, data path {path}")
        _more(len(s.pools), MAX_POOL_ROWS, "    ", "pools")
    _more(len(stats.sessions), MAX_ROWS, "  ", "sessions")
    print(f"\npool groups ({len(stats.groups)}):")
    for g in stats.groups[:MAX_ROWS]:
        print(
            f"  {shown(g.group)}  model '{shown(g.model_name)}'  sessions {g.sessions}"
            + (f" (+{g.holds} attaching or ending)" if g.holds else "")
            + f"  indexed pages {g.indexed_pages}"
        )
        for p in g.pools[:MAX_POOL_ROWS]:
            print(
                f"    {shown(p.name):12} {p.total_pages - p.free_pages:>8}/{p.total_pages:<8} pages used"
                f"  {p.page_bytes} B/page  {shown(p.segment)}"
            )
        _more(len(g.pools), MAX_POOL_ROWS, "    ", "pools")
    _more(len(stats.groups), MAX_ROWS, "  ", "pool groups")
    print(f"\nretraction backups ({len(stats.backups)}):")
    for b in stats.backups[:MAX_ROWS]:
        print(
            f"  {shown(b.backup_id)}  request '{shown(b.request_id)}'  {b.pages} pages"
            f"  session {shown(b.session_id)}"
        )
    _more(len(stats.backups), MAX_ROWS, "  ", "retraction backups")
    print("\nL3:")
    for be in stats.backends[:MAX_ROWS]:
        print(
            f"  {shown(be.name)}: {be.pages} pages, {be.bytes / 2**20:.1f} MiB"
            f" hits {be.hits} misses {be.misses} corrupt {be.corrupt_pages}"
        )
        if be.error:  # the figures above are the last the backend gave
            age = f"figures {be.age_ms / 1000:.0f} s old" if be.age_ms else "no figures yet"
            print(f"    UNAVAILABLE: {shown(be.error)} ({age})")
    _more(len(stats.backends), MAX_ROWS, "  ", "backends")
    if not stats.backends:
        print("  none")


def _as_json(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {k: _as_json(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, list | tuple):
        return [_as_json(v) for v in value]
    return value
