"""Targets, channel construction, credentials and the retry policy (as a gRPC service config).

Shared by the sync and the asyncio client. Everything here is immutable and
thread-safe; channels built here are owned (and closed) by the client that
asked for them.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

SOCKET_ENV = "HICACHED_SOCKET"
SOCKET_NAME = "hicached.sock"
SYSTEM_SOCKET = Path("/run/hicached") / SOCKET_NAME

# Large enough for GetBytes/PutBytes batches of many pages; the daemon enforces its own limit.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# The largest answer accepted: the daemon's default server.max_message_bytes, the most a daemon
# at its defaults can send (its limits.max_response_bytes, 32 MiB, is capped by it). An answer
# is received, parsed and converted whole, so up to 256 MiB per call was what a hostile daemon
# or impostor could make the worker allocate; raise it with the daemon's limits.
DEFAULT_MAX_RECEIVE_BYTES = 64 * 1024 * 1024


def default_target() -> str:
    """The daemon's default endpoint, as a gRPC target (the daemon's own default socket).

    ``$HICACHED_SOCKET`` (a path or a full target) wins; else
    ``$XDG_RUNTIME_DIR/hicached/hicached.sock`` when ``XDG_RUNTIME_DIR`` is set;
    else ``/run/hicached/hicached.sock`` for root and
    ``/tmp/hicached-<uid>/hicached.sock`` for other users.
    """
    env = os.environ.get(SOCKET_ENV)
    if env:
        return socket_target(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        path = Path(runtime) / "hicached" / SOCKET_NAME
    elif os.geteuid() == 0:
        path = SYSTEM_SOCKET
    else:
        path = Path(f"/tmp/hicached-{os.geteuid()}") / SOCKET_NAME
    return normalize_target(str(path))


ADMIN_SOCKET_ENV = "HICACHED_ADMIN_SOCKET"
ADMIN_SOCKET_NAME = "admin.sock"


def default_admin_target() -> str:
    """The daemon's default admin socket, as a gRPC target (for ``hicached status`` and admin tools).

    ``$HICACHED_ADMIN_SOCKET`` wins; else ``admin.sock`` next to the worker socket
    :func:`default_target` names (the daemon's default ``server.admin_socket``).
    """
    env = os.environ.get(ADMIN_SOCKET_ENV)
    if env:
        return socket_target(env)
    worker = default_target()
    if not worker.startswith("unix://"):
        return worker  # a TCP target: the admin role is the admin token there
    return normalize_target(str(Path(worker.removeprefix("unix://")).parent / ADMIN_SOCKET_NAME))


def normalize_target(target: str) -> str:
    """``/path/sock`` -> ``unix:///path/sock``; a relative path (``run/d.sock``: a ``/`` before
    any ``:``; ``d.sock``: a name ending in ``.sock``) or one from ``~`` -> the absolute one, as
    the daemon bound it from its working directory; ``unix:...``, ``dns:...``, ``host:port``
    and a bare host name unchanged."""
    if not target:
        raise ValueError("empty hicached target; give unix:///path/to.sock or host:port")
    if target.startswith("/"):
        return f"unix://{target}"  # as given: a lexical clean-up of ".." could change where it leads
    if target.startswith("~") or socket_path_like(target):
        return f"unix://{os.path.abspath(os.path.expanduser(target))}"
    return target


def socket_target(value: str, *, full_targets: bool = True) -> str:
    """A value that names a socket (``$HICACHED_SOCKET``, ``--socket``) as a gRPC target: a
    path, relative ones too, whatever its name; a ``unix:`` target as is, and with
    ``full_targets`` any value with a ``:`` (``host:port``; without, ``a:b.sock`` is a path)."""
    if value.startswith(("/", "~", ".", "unix:")) or (full_targets and ":" in value):
        return normalize_target(value)
    return normalize_target(f"./{value}")


def socket_path_like(text: str) -> bool:
    """A relative path, not a gRPC target: a ``/`` before any ``:``, or no ``:`` and ``.sock``."""
    head = text.split("/", 1)[0]
    return ("/" in text and ":" not in head) or (":" not in text and text.endswith(".sock"))


def check_metadata(name: str, value: str | None) -> None:
    """ValueError naming ``name`` unless ``value`` can be sent as gRPC metadata (printable
    ASCII: a trailing newline from ``open(f).read()`` would make every call fail)."""
    bad = next((i for i, c in enumerate(value or "") if not " " <= c <= "~"), None)
    if bad is not None:
        # The offending character and where, never the value: it is a credential.
        raise ValueError(
            f"{name} must be printable ASCII: it has {value[bad]!r} at position {bad} "  # type: ignore[index]
            "(strip what was read from a file)"
        )


def is_unix_target(target: str) -> bool:
    return target.startswith("unix:")


# gRPC's own ceiling on attempts: a service config asking for more is clamped to it.
MAX_ATTEMPTS = 5
# Measured with grpcio 1.85 over a Unix socket: a first backoff of 1 ms stalled about half
# of the retried calls until their deadline (the retry never went out); 10 ms never did.
MIN_BACKOFF_S = 0.01
SERVICES = ("hicached.v1.HiCacheService", "hicached.v1.AdminService")
# The server-streaming RPCs: the client retries them itself (see RetryPolicy.stream_retry_s).
STREAMS = ("Load", "RetractRestore")
# Reconnect backoff of a Unix-socket channel. gRPC's defaults (1 s, x1.6, up to 120 s) are
# meant for remote servers: after a local daemon restart a client waited up to minutes (38 s
# measured) for its next connect attempt. A failed connect to a local socket costs
# microseconds, so retry every 0.1 s growing to 1 s: back within about a second of SERVING.
# gRPC core reads ``min_reconnect_backoff_ms`` as the floor of an attempt's connect deadline
# (20 s by default): 1 s still gives a busy daemon time to finish the handshake.
UNIX_RECONNECT_BACKOFF_MS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 1000,
    "grpc.max_reconnect_backoff_ms": 1000,
}


def _duration(seconds: float) -> str:
    """A service-config duration (``"0.05s"``): decimal seconds, no exponent."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries of calls that failed with a transient status, done by the gRPC channel.

    :meth:`service_config` turns the policy into the channel's ``retryPolicy`` (gRPC's own
    retries: exponential backoff with jitter, the overall deadline spanning every attempt,
    and the daemon's ``grpc-retry-pushback-ms`` hint waited instead of the backoff). A retry
    re-sends the SAME request, so a mutating call keeps its ``op_id`` and the daemon answers
    a retry of a request it already executed with the first answer instead of executing it
    twice. A stream is retried only before its first message arrives (gRPC commits the call
    then). ``retry_resource_exhausted`` also retries backpressure (``RESOURCE_EXHAUSTED``).
    Attach is never retried: its fd-handoff ticket serves one attempt (a transient failure
    raises; attach again).
    """

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    retry_codes: frozenset[grpc.StatusCode] = frozenset(
        {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
    )
    retry_resource_exhausted: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= MAX_ATTEMPTS:
            raise ValueError(
                f"RetryPolicy.max_attempts must be 1..{MAX_ATTEMPTS} (gRPC's limit), got {self.max_attempts}"
            )
        if self.initial_backoff_s < MIN_BACKOFF_S or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"RetryPolicy backoff must be >= {MIN_BACKOFF_S} s and max_backoff_s >= initial_backoff_s, got {self}"
            )
        if self.multiplier <= 0:
            raise ValueError(f"RetryPolicy.multiplier must be > 0, got {self.multiplier}")
        if grpc.StatusCode.OK in self.retry_codes:
            raise ValueError("RetryPolicy.retry_codes cannot contain OK")

    def codes(self) -> frozenset[grpc.StatusCode]:
        """The status codes retried (none with a single attempt)."""
        if self.max_attempts == 1:
            return frozenset()
        if self.retry_resource_exhausted:
            return self.retry_codes | {grpc.StatusCode.RESOURCE_EXHAUSTED}
        return self.retry_codes

    def retries(self, code: grpc.StatusCode) -> bool:
        return code in self.codes()

    def stream_retry_s(
        self, attempt: int, code: grpc.StatusCode, pushback_ms: int | None, left_s: float | None
    ) -> float | None:
        """How long a stream that failed before its first message, on its ``attempt``-th try,
        waits before the next; None: it fails. gRPC's rules for a call it retries: the codes
        and attempts of this policy, the server's pushback first (negative: no retry), else
        a jittered exponential backoff, and no try that would start past the deadline
        (``left_s``, None: none). The channel does not retry streams: in grpcio's blocking
        client, a retried stream whose connection died under it (the daemon killed) waited
        forever, past its deadline."""
        if attempt >= self.max_attempts or not self.retries(code):
            return None
        if pushback_ms is not None:
            delay = pushback_ms / 1000 if pushback_ms >= 0 else None
        else:
            cap = min(self.initial_backoff_s * self.multiplier ** (attempt - 1), self.max_backoff_s)
            delay = random.uniform(0, cap)
        return None if delay is None or (left_s is not None and delay >= left_s) else delay

    def service_config(self) -> dict[str, Any]:
        """The channel's service config (``grpc.service_config``): retries for every RPC but
        Attach (its fd ticket serves once) and the streams (:meth:`stream_retry_s`)."""
        plain = {"name": [{"service": SERVICES[0], "method": m} for m in ("Attach", *STREAMS)]}
        if self.max_attempts == 1:
            return {"methodConfig": [plain]}
        policy = {
            "maxAttempts": self.max_attempts,
            "initialBackoff": _duration(self.initial_backoff_s),
            "maxBackoff": _duration(self.max_backoff_s),
            "backoffMultiplier": self.multiplier,
            "retryableStatusCodes": sorted(code.name for code in self.codes()),
        }
        every = {"name": [{"service": s} for s in SERVICES], "retryPolicy": policy}
        # The most specific name wins: the entry of the methods (no retryPolicy) overrides the service's.
        return {"methodConfig": [every, plain]}


NO_RETRY = RetryPolicy(max_attempts=1)
# The channel option that sets the heartbeats' connection apart (see channel_options).
HEARTBEAT_OPTION = "hicached.heartbeats"


@dataclass(frozen=True)
class ChannelConfig:
    """Where and how to reach the daemon.

    ``token`` is sent as ``authorization: Bearer <token>`` on every call.
    ``credentials`` (``grpc.ssl_channel_credentials(...)``) selects TLS for TCP
    targets. ``timeout_s`` is the default overall deadline of a call,
    retries included (``None`` = no deadline). A Unix-socket channel reconnects
    quickly after a daemon restart (:data:`UNIX_RECONNECT_BACKOFF_MS`); ``options``
    override any channel option, these included. ``max_message_bytes`` bounds what the channel
    sends and accepts, ``max_receive_bytes`` (:data:`DEFAULT_MAX_RECEIVE_BYTES`) what it
    accepts: an answer over the smaller is RESOURCE_EXHAUSTED before it is parsed.
    """

    target: str = field(default_factory=default_target)
    token: str | None = field(default=None, repr=False)  # a credential: never in a log line
    credentials: grpc.ChannelCredentials | None = None
    timeout_s: float | None = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES
    options: Sequence[tuple[str, Any]] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", normalize_target(self.target))
        if self.credentials is not None and is_unix_target(self.target):
            raise ValueError(f"TLS credentials are for TCP targets, not {self.target!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")
        check_metadata("token", self.token)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_options(self, *, heartbeats: bool = False) -> list[tuple[str, Any]]:
        """The channel's options; ``heartbeats``: for the heartbeats' channel. gRPC shares one
        connection (and its stream limit) among a process's channels of equal options, so
        the heartbeats of every client of the process share one connection of their own,
        apart from the data calls'."""
        opts: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", min(self.max_message_bytes, self.max_receive_bytes)),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(self.retry.service_config())),
            # A request larger than the retry buffer (256 KiB by default) is never retried.
            ("grpc.per_rpc_retry_buffer_size", self.max_message_bytes),
        ]
        if is_unix_target(self.target):
            # The authority of a UDS target is the socket path, which is not a valid
            # :authority for HTTP/2 proxies or TLS; a fixed name keeps servers happy.
            opts.append(("grpc.default_authority", "localhost"))
            opts.extend(UNIX_RECONNECT_BACKOFF_MS.items())
        if heartbeats:
            opts.append((HEARTBEAT_OPTION, 1))  # unknown to gRPC: it only tells the two apart
        opts.extend(self.options)
        return opts

    def sync_channel(self, *, heartbeats: bool = False) -> grpc.Channel:
        options = self.channel_options(heartbeats=heartbeats)
        if self.credentials is not None:
            return grpc.secure_channel(self.target, self.credentials, options=options)
        return grpc.insecure_channel(self.target, options=options)

    def aio_channel(self, *, heartbeats: bool = False) -> grpc.aio.Channel:
        options = self.channel_options(heartbeats=heartbeats)
        if self.credentials is not None:
            return grpc.aio.secure_channel(self.target, self.credentials, options=options)
        return grpc.aio.insecure_channel(self.target, options=options)
