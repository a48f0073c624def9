"""The asyncio gRPC servers: listeners, health, reflection, auth, lease reaper.

Three listeners, each its own grpc.aio server with servicers bound to one
role (:mod:`hicached.server.roles`):

* the worker socket ``server.socket`` (mode ``server.socket_mode``);
* the admin socket ``server.admin_socket`` (0600, or 0660 with
  ``server.admin_group``): Drain, Resume, ClearNamespace, full GetStats;
* TCP ``server.listen`` (optional): TLS when certificates are configured,
  and it fails closed: a token (worker or admin) or mTLS is required unless
  ``server.insecure_tcp``; reflection needs the token, health stays open (and answers only the daemon's
  names, :mod:`hicached.server.health`).

Both sockets are claimed before anything else starts
(:mod:`hicached.server.sockets`): directory checks, live-daemon probe,
restrictive umask, inode-exact unlink at stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection
from hicached_client.v1 import hicached_pb2 as pb

from hicached.config import Config
from hicached.core.service import HiCacheCore
from hicached.errors import StartupError
from hicached.server import sockets
from hicached.server.credentials import TcpCredentials
from hicached.server.decode import DecodeInterceptor
from hicached.server.fastlane import lane_path
from hicached.server.handoff import handoff_path
from hicached.server.health import SERVICE_NAME as HEALTH_SERVICE
from hicached.server.health import HealthServicer, HealthStatus
from hicached.server.held import HeldRequestsInterceptor
from hicached.server.interceptors import (
    ErrorInterceptor,
    MetricsInterceptor,
    SessionInterceptor,
    TokenInterceptor,
)
from hicached.server.observer import RpcObserver
from hicached.server.peers import HeldRequests
from hicached.server.roles import Access

logger = logging.getLogger(__name__)

# How long a peer has to answer a keepalive ping before its connection is dropped.
KEEPALIVE_TIMEOUT_MS = 20_000
# How long a new connection may take to finish its handshake (and its HTTP/2 preface) before
# it stops counting against server.max_connections: grpc's own default let a connection that
# sends nothing hold its slot for about a minute, so reconnecting once a minute kept every
# other client of the listener out.
HANDSHAKE_TIMEOUT_MS = 5_000

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["HiCacheService"].full_name,
    pb.DESCRIPTOR.services_by_name["AdminService"].full_name,
)


Registrations = Callable[[Access], Sequence[Callable[[grpc.aio.Server], None]]]


def claim_sockets(config: Config) -> int | None:
    """Check the socket directories and probe every socket path (before the L3 lock, so a
    second daemon's error names the first one; and before anything is served, so a refusal
    is one line); the admin group's gid. StartupError."""
    cfg = config.server
    gid = sockets.group_id(cfg.admin_group) if cfg.admin_group else None
    sockets.claim(Path(cfg.socket), gid=gid, side=sockets.SIDE_SUFFIX)
    # The default admin socket sits beside the worker socket: server.socket chose its path.
    admin_key = "server.admin_socket" if cfg.admin_socket else "server.socket"
    sockets.claim(cfg.admin_socket_path(), gid=gid, key=admin_key)
    sockets.probe(handoff_path(cfg.socket))
    if cfg.fast_lane:
        sockets.probe(lane_path(cfg.socket))
    return gid


class Server:
    """Owns the grpc.aio servers of the listeners; ``start``/``stop`` once each.

    ``registrations(access)`` returns the servicer registrations of one listener,
    built for that listener's role. ``observe`` gets one observation per RPC of the
    daemon's services (the Prometheus RPC metrics).
    """

    def __init__(
        self,
        config: Config,
        core: HiCacheCore,
        registrations: Registrations,
        *,
        credentials: TcpCredentials,
        observe: RpcObserver,
        admin_gid: int | None = None,
    ) -> None:
        self._cfg = config
        self._core = core
        self._registrations = registrations
        self._creds = credentials
        self._observe = observe
        self._admin_gid = admin_gid
        self._servers: list[grpc.aio.Server] = []
        self._bound: list[sockets.BoundSocket] = []
        # One status for every listener; each listener counts its own Watch streams.
        self._health = HealthStatus(("", *SERVICE_NAMES))
        self.tcp_port: int | None = None

    def _interceptors(self, access: Access) -> tuple[grpc.aio.ServerInterceptor[Any, Any], ...]:
        """Outermost first (docs: :mod:`hicached.server.interceptors`). The listener's token
        refuses before anything is decoded; undecodable bytes are INVALID_ARGUMENT before any
        per-call work; errors map to status around the metrics, which observe every answer of
        the daemon's services, including the session checks' refusals; a request is counted
        against its peer last, once its session is known to be the caller's."""
        ours = SERVICE_NAMES
        token = (TokenInterceptor(access),) if access.tcp else ()
        return (
            *token,
            DecodeInterceptor(
                max_request_bytes=min(self._cfg.limits.max_request_bytes, self._cfg.server.max_message_bytes),
                max_put_pages=self._cfg.limits.max_keys_per_request,
            ),
            ErrorInterceptor(ours),
            MetricsInterceptor(self._observe, ours),
            SessionInterceptor(self._core, self._cfg.limits, ours),
            # Each listener its own count, as for connections: the admin socket stays usable.
            HeldRequestsInterceptor(
                self._core, HeldRequests(self._cfg.limits.max_request_bytes_held_per_peer), ours
            ),
        )

    def _new_server(self, access: Access) -> grpc.aio.Server:
        cfg = self._cfg.server
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # What one peer can make a listener hold (docs/limits.md, "Connections"): idle
            # connections are closed, a peer that stops answering pings is dropped with the
            # answers it left unread, and the connections and their open calls are counted.
            ("grpc.max_allowed_incoming_connections", cfg.max_connections),
            ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
            ("grpc.max_connection_idle_ms", int(cfg.idle_connection_s * 1000)),
            ("grpc.keepalive_time_ms", int(cfg.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ]
        server = grpc.aio.server(options=options, interceptors=self._interceptors(access))
        for register in self._registrations(access):
            register(server)
        HealthServicer(self._health, max_watchers=cfg.max_health_watchers).add_to_server(server)
        reflection.enable_server_reflection((*SERVICE_NAMES, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
        self._servers.append(server)
        return server

    async def start(self) -> None:
        cfg = self._cfg.server
        admin_path = cfg.admin_socket_path()
        worker = self._new_server(Access(str(admin_path)))
        admin = self._new_server(Access(str(admin_path), admin=True))
        sock = Path(cfg.socket)
        Bound = sockets.BoundSocket
        private = (Bound.private_path(sock, "w"), Bound.private_path(admin_path, "a"))
        admin_mode = 0o660 if self._admin_gid is not None else 0o600
        # gRPC binds at add_insecure_port: each socket is created with its mode (no chmod).
        with sockets.umask_for(cfg.socket_mode):
            worker.add_insecure_port(f"unix:{private[0]}")
        with sockets.umask_for(admin_mode):
            admin.add_insecure_port(f"unix:{private[1]}")
        await worker.start()
        await admin.start()
        self._bound.append(Bound.publish(private[0], sock))
        self._bound.append(Bound.publish(private[1], admin_path, self._admin_gid))
        if cfg.listen:
            await self._start_tcp(str(admin_path))
        for name in ("", *SERVICE_NAMES):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "serving",
            extra={
                "event": "serving",
                "socket": str(sock),
                "admin_socket": str(admin_path),
                "listen": cfg.listen or None,
            },
        )

    async def _start_tcp(self, admin_path: str) -> None:
        cfg, creds = self._cfg.server, self._creds
        access = Access(admin_path, tcp=True, worker_token=creds.worker_token, admin_token=creds.admin_token)
        if cfg.insecure_tcp and creds.worker_token is None and creds.tls_client_ca is None:
            logger.warning(
                "server.insecure_tcp: TCP %s serves every client without authentication",
                cfg.listen,
                extra={"event": "insecure_tcp", "listen": cfg.listen},
            )
        tcp = self._new_server(access)
        try:
            if creds.tls_cert is not None and creds.tls_key is not None:
                tls = grpc.ssl_server_credentials(
                    [(creds.tls_key, creds.tls_cert)],
                    root_certificates=creds.tls_client_ca,
                    require_client_auth=creds.tls_client_ca is not None,
                )
                self.tcp_port = tcp.add_secure_port(cfg.listen, tls)
            else:
                self.tcp_port = tcp.add_insecure_port(cfg.listen)
        except RuntimeError as exc:  # grpc's "Failed to bind to address ..."
            raise StartupError(
                f"server.listen {cfg.listen}: cannot listen there (the port is in use or the address "
                "is not one of this host's)"
            ) from exc
        await tcp.start()

    async def mark_draining(self) -> None:
        """Readiness: the services stop SERVING (no new sessions); ``""`` (liveness) stays SERVING."""
        for name in SERVICE_NAMES:
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def mark_serving(self) -> None:
        """Readiness back to SERVING (Resume undid a Drain)."""
        for name in SERVICE_NAMES:
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight RPCs finish for ``grace_s``, then cancel them."""
        self._health.enter_graceful_shutdown()
        await asyncio.gather(*(server.stop(grace_s) for server in self._servers))
        for bound in self._bound:
            bound.unlink()

    async def wait(self) -> None:
        await asyncio.gather(*(server.wait_for_termination() for server in self._servers))


__all__ = ["RpcObserver", "Server"]
