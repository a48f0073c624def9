"""Flags, the client and messages shared by the commands that talk to a running daemon
(status, lookup): what a daemon answers is bounded (:data:`MAX_ANSWER_BYTES`) and escaped
(:func:`hicached.commands._common.shown`), since a stranger's process may answer instead.

Thread-safety: pure functions; each command builds and closes its own client.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
from hicached_client import HiCacheClient
from hicached_client._channel import (
    ADMIN_SOCKET_NAME,
    SOCKET_ENV,
    SOCKET_NAME,
    default_target,
    is_unix_target,
    normalize_target,
    socket_target,
)

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
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--socket", help=f"daemon Unix socket (default: {default_help})")
    where.add_argument("--target", help="gRPC target instead of --socket (host:port or unix:///path)")
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=5.0,
        help=f"seconds to wait for the daemon (more than 0, at most {MAX_TIMEOUT_S:.0f}; default: %(default)s)",
    )
    tcp = parser.add_argument_group("a TCP target (--target host:port)")
    tcp.add_argument(
        "--token-file", type=Path, help="file holding the bearer token (the daemon's worker or admin token)"
    )
    tcp.add_argument("--tls-ca", type=Path, help="CA the daemon's certificate is checked against (TLS on)")
    tcp.add_argument("--tls-cert", type=Path, help="client certificate, where the daemon asks for one (mTLS)")
    tcp.add_argument("--tls-key", type=Path, help="the client certificate's private key")


def _flag_file(flag: str, path: Path) -> bytes:
    """The bytes of a flag's file; unreadable, a one-line usage error (exit 2)."""
    try:
        return path.read_bytes()
    except OSError as exc:
        print(f"hicached: {flag} {shown(str(path))}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None


def tcp_credentials(
    args: argparse.Namespace, target: str
) -> tuple[str | None, grpc.ChannelCredentials | None]:
    """(bearer token, TLS credentials) of the TCP flags; a usage error (exit 2) when one is
    unreadable, or TLS is asked for a Unix socket."""
    token = (
        _flag_file("--token-file", args.token_file).decode("utf-8", "replace").strip()
        if args.token_file
        else None
    )
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return token, None
    if is_unix_target(target):
        print(
            "hicached: --tls-ca/--tls-cert/--tls-key are for a TCP target (--target host:port)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if bool(args.tls_cert) != bool(args.tls_key):
        print("hicached: --tls-cert and --tls-key go together", file=sys.stderr)
        raise SystemExit(2)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_flag_file("--tls-ca", args.tls_ca) if args.tls_ca else None,
        private_key=_flag_file("--tls-key", args.tls_key) if args.tls_key else None,
        certificate_chain=_flag_file("--tls-cert", args.tls_cert) if args.tls_cert else None,
    )
    return token, credentials


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
    token, credentials = tcp_credentials(args, target)
    return HiCacheClient(
        target,
        token=token,
        credentials=credentials,
        timeout_s=args.timeout,
        max_message_bytes=MAX_ANSWER_BYTES,
    )


def target_of(args: argparse.Namespace, default: Callable[[], str] = default_target) -> str:
    if args.target:
        return normalize_target(str(args.target))
    if args.socket:  # a Unix socket: a name with ":" is no host:port here
        return socket_target(str(args.socket), full_targets=False)
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
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return f"hicached: {target}: {code.name}: {details} (the CLI sends a token with --token-file)"
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
    served = where
    if Path(where).name == ADMIN_SOCKET_NAME:  # a daemon serves it beside its worker socket
        worker = default_target().removeprefix("unix://")
        served = (
            worker if Path(worker).parent == Path(where).parent else str(Path(where).with_name(SOCKET_NAME))
        )
    start = (
        f"hicached serve --socket {served}"
        if target.startswith("unix:")
        else "hicached serve --listen HOST:PORT"
    )
    return (
        f"hicached: no daemon is answering at {where} ({reason}).\n"
        f"Start one with `{start}` (or `./dev serve` in a checkout), or point --socket / "
        f"${SOCKET_ENV} at the running one."
    )
