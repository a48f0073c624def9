"""The asyncio gRPC server: listeners, health, reflection, auth, lease reaper.

The Unix socket is the default listener (mode ``server.socket_mode``; the
socket directory's permissions are the access control). TCP is optional; it
uses TLS (optionally mutual) when certificates are configured and requires a
bearer token when ``server.auth_token_file`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from hicached_client.v1 import hicached_pb2 as pb

from hicached.config import Config
from hicached.core.service import HiCacheCore
from hicached.server.servicer import RpcObserver

logger = logging.getLogger(__name__)

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["HiCacheService"].full_name,
    pb.DESCRIPTOR.services_by_name["AdminService"].full_name,
)


class Server:
    """Owns the grpc.aio server and the RPC thread pool; ``start``/``stop`` once each."""

    def __init__(
        self,
        config: Config,
        core: HiCacheCore,
        registrations: Sequence[Callable[[grpc.aio.Server], None]],
        *,
        executor: ThreadPoolExecutor,
    ) -> None:
        self._cfg = config
        self._core = core
        self._registrations = registrations
        self._executor = executor
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._reaper: asyncio.Task[None] | None = None
        self.tcp_port: int | None = None

    async def start(self) -> None:
        cfg = self._cfg.server
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options)
        for register in self._registrations:
            register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        sock = Path(cfg.socket)
        sock.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()  # a stale socket of a dead daemon; a live one would hold the name
        server.add_insecure_port(f"unix:{sock}")
        if cfg.listen:
            self.tcp_port = (
                server.add_secure_port(cfg.listen, self._tls())
                if cfg.tls_cert
                else (server.add_insecure_port(cfg.listen))
            )
        await server.start()
        os.chmod(sock, cfg.socket_mode)
        self._server = server
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap())
        logger.info("serving", extra={"event": "serving", "socket": str(sock), "listen": cfg.listen or None})

    def _tls(self) -> grpc.ServerCredentials:
        cfg = self._cfg.server
        key = Path(cfg.tls_key).read_bytes()
        cert = Path(cfg.tls_cert).read_bytes()
        ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    async def _reap(self) -> None:
        """End sessions whose lease ran out (and backups past their lease)."""
        interval = max(0.05, min(1.0, self._cfg.sessions.min_lease_ms / 4000))
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            try:
                await loop.run_in_executor(self._executor, self._core.expire)
            except Exception:
                logger.exception("lease reaper failed")

    async def mark_draining(self) -> None:
        """Readiness: the services stop SERVING (no new sessions); ``""`` (liveness) stays SERVING."""
        for name in SERVICE_NAMES:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight RPCs finish for ``grace_s``, then cancel them."""
        if self._reaper is not None:
            self._reaper.cancel()
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
        with contextlib.suppress(FileNotFoundError):
            Path(self._cfg.server.socket).unlink()

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


__all__ = ["RpcObserver", "Server"]
