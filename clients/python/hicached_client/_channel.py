"""Targets, channel construction, credentials and the retry policy.

Shared by the sync and the asyncio client. Everything here is immutable and
thread-safe; channels built here are owned (and closed) by the client that
asked for them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from hicached_client.errors import HiCacheError

SOCKET_ENV = "HICACHED_SOCKET"
SOCKET_NAME = "hicached.sock"
SYSTEM_SOCKET = Path("/run/hicached") / SOCKET_NAME

# Large enough for GetBytes/PutBytes batches of many pages; the daemon enforces its own limit.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def default_target() -> str:
    """The daemon's default endpoint, as a gRPC target (the daemon's own default socket).

    ``$HICACHED_SOCKET`` (a path or a full target) wins; else
    ``$XDG_RUNTIME_DIR/hicached/hicached.sock`` when ``XDG_RUNTIME_DIR`` is set;
    else ``/run/hicached/hicached.sock`` for root and
    ``/tmp/hicached-<uid>/hicached.sock`` for other users.
    """
    env = os.environ.get(SOCKET_ENV)
    if env:
        return normalize_target(env)
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
        return normalize_target(env)
    worker = default_target()
    if not worker.startswith("unix://"):
        return worker  # a TCP target: the admin role is the admin token there
    return normalize_target(str(Path(worker.removeprefix("unix://")).parent / ADMIN_SOCKET_NAME))


def normalize_target(target: str) -> str:
    """``/path/sock`` -> ``unix:///path/sock``; ``unix:...`` and ``host:port`` unchanged."""
    if not target:
        raise ValueError("empty hicached target; give unix:///path/to.sock or host:port")
    if target.startswith("/"):
        return f"unix://{target}"
    return target


def is_unix_target(target: str) -> bool:
    return target.startswith("unix:")


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries of calls that failed with a transient status.

    Mutating calls are retried with the SAME ``op_id``, so the daemon answers
    a retry of a request it already executed with the first answer instead of
    executing it twice. ``retry_resource_exhausted`` also retries backpressure
    (``RESOURCE_EXHAUSTED``), waiting the daemon's ``retry-after-ms`` hint.
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
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError(f"RetryPolicy backoff must be >= 0 and multiplier >= 1, got {self}")

    def delay_s(self, attempt: int, error: HiCacheError) -> float | None:
        """Seconds to wait before retry number ``attempt`` (1-based), or ``None``: do not retry."""
        if attempt >= self.max_attempts:
            return None
        if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and self.retry_resource_exhausted:
            if error.retry_after_ms is not None:
                return error.retry_after_ms / 1000.0
        elif error.code not in self.retry_codes:
            return None
        backoff = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        # Jitter keeps several workers that lost the daemon together from retrying in lockstep.
        return backoff * (0.5 + random.random() / 2)


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class ChannelConfig:
    """Where and how to reach the daemon.

    ``token`` is sent as ``authorization: Bearer <token>`` on every call.
    ``credentials`` (``grpc.ssl_channel_credentials(...)``) selects TLS for TCP
    targets. ``timeout_s`` is the default overall deadline of a call,
    retries included (``None`` = no deadline).
    """

    target: str = field(default_factory=default_target)
    token: str | None = None
    credentials: grpc.ChannelCredentials | None = None
    timeout_s: float | None = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    options: Sequence[tuple[str, Any]] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", normalize_target(self.target))
        if self.credentials is not None and is_unix_target(self.target):
            raise ValueError(f"TLS credentials are for TCP targets, not {self.target!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_options(self) -> list[tuple[str, Any]]:
        opts: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]
        if is_unix_target(self.target):
            # The authority of a UDS target is the socket path, which is not a valid
            # :authority for HTTP/2 proxies or TLS; a fixed name keeps servers happy.
            opts.append(("grpc.default_authority", "localhost"))
        opts.extend(self.options)
        return opts

    def sync_channel(self) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(self.target, self.credentials, options=self.channel_options())
        return grpc.insecure_channel(self.target, options=self.channel_options())

    def aio_channel(self) -> grpc.aio.Channel:
        if self.credentials is not None:
            return grpc.aio.secure_channel(self.target, self.credentials, options=self.channel_options())
        return grpc.aio.insecure_channel(self.target, options=self.channel_options())
