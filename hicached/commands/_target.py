"""Flags, the client and messages shared by the commands that talk to a running daemon
(status, lookup): what a daemon answers is bounded (:data:`MAX_ANSWER_BYTES`) and escaped
(:func:`hicached.commands._common.shown`), since a stranger's process may answer instead.

Thread-safety: pure functions; each command builds and closes its own client.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import grpc
from hicached_client import HiCacheClient
from hicached_client._channel import SOCKET_ENV, default_target, normalize_target

from hicached.commands._common import shown

# The largest answer these commands accept (the client library's default is 256 MiB, for byte
# batches). An honest GetStats is far smaller: a peer's 256 sessions of 32 pools, every name
# at its limit, come to 1.4 MiB, all 64 pool groups to 0.7 MiB. An answer is parsed and
# converted whole before a line is printed: a stranger answering on the socket made `status`
# take 46 s and 1.2 GiB with 16 MiB of tiny sessions, 212 s and 4.6 GiB with 64 MiB.
MAX_ANSWER_BYTES = 16 << 20


def add_target_flags(
    parser: argparse.ArgumentParser,
    default_help: str = f"${SOCKET_ENV}, else the daemon's default path",
) -> None:
    parser.add_argument("--socket", help=f"daemon Unix socket (default: {default_help})")
    parser.add_argument("--target", help="gRPC target instead of --socket (host:port or unix:///path)")
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=5.0,
        help=f"seconds to wait for the daemon (more than 0, at most {MAX_TIMEOUT_S:.0f}; default: %(default)s)",
    )


# The longest --timeout: gRPC turned a deadline of 1e10 s or more into DEADLINE_EXCEEDED at once.
MAX_TIMEOUT_S = 86400.0


def seconds(text: str) -> float:
    """``--timeout``'s type: a number of seconds above 0 and at most :data:`MAX_TIMEOUT_S`;
    otherwise argparse's usage error (exit 2). 0 or -1 ended in a ValueError traceback from the
    client, ``nan`` and ``inf`` in DEADLINE_EXCEEDED at once."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f}"
        )
    return value


def client_of(args: argparse.Namespace, target: str) -> HiCacheClient:
    """The client these commands ask ``target`` with: ``--timeout``, answers up to
    :data:`MAX_ANSWER_BYTES` (a larger one fails RESOURCE_EXHAUSTED)."""
    return HiCacheClient(target, timeout_s=args.timeout, max_message_bytes=MAX_ANSWER_BYTES)


def target_of(args: argparse.Namespace, default: Callable[[], str] = default_target) -> str:
    if args.target:
        return normalize_target(str(args.target))
    if args.socket:
        return normalize_target(str(args.socket))
    return default()


# How gRPC's transport words a call that reached no daemon (a refused, missing or forbidden
# socket is "failed to connect to all addresses; last error: ..."); any other UNAVAILABLE is
# the daemon's own answer ("daemon is draining ...", an L3 backend's refusal), which "start
# one there" would misread.
_UNREACHED = ("failed to connect to all addresses", "DNS resolution failed", "Socket closed")


def failure_message(target: str, code: grpc.StatusCode, details: str) -> str:
    """One line for a failed call; for an unreachable daemon, how to start one there, and for
    a socket this user may not open, whose it is. ``details`` (the server's, or gRPC's) is
    escaped with :func:`shown`."""
    details = shown(details)
    if code is not grpc.StatusCode.UNAVAILABLE or not any(m in details for m in _UNREACHED):
        return f"hicached: {target}: {code.name}: {details}"
    where = target.removeprefix("unix://")
    reason = details.rsplit("error: ", 1)[-1] if "error: " in details else details
    if "Permission denied" in details:
        return (
            f"hicached: {where}: this user may not open it ({reason}). The admin socket is for the "
            "daemon's uid and server.admin_group; a worker's uid asks the worker socket "
            f"(--socket <the worker socket> or ${SOCKET_ENV})."
        )
    start = (
        f"hicached serve --socket {where}"
        if target.startswith("unix:")
        else "hicached serve --listen HOST:PORT"
    )
    return (
        f"hicached: no daemon is answering at {where} ({reason}).\n"
        f"Start one with `{start}` (or `./dev serve` in a checkout), or point --socket / "
        f"${SOCKET_ENV} at the running one."
    )
