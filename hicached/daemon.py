"""The composition root: builds every part of the daemon from one ``Config``.

Nothing else constructs the engine, the storage backend, the pool groups, the
core or the server; tests and the CLI go through :class:`Daemon`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace

import grpc
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc

from hicached.config import Config, ConfigError, as_dict
from hicached.core.group_state import GroupState
from hicached.core.groups import GroupRegistry
from hicached.core.keyed import KeyedCache
from hicached.core.keyed_types import KeyedOptions
from hicached.core.service import HiCacheCore
from hicached.errors import FailedPrecondition, StartupError
from hicached.index.index import ContentIndex
from hicached.index.observer import IndexObserver, NullIndexObserver
from hicached.index.types import IndexOptions
from hicached.l3.base import StorageBackend
from hicached.l3.stats_cache import StatsCache
from hicached.logs import setup_logging
from hicached.metrics import Metrics, MetricsServer, serve_metrics
from hicached.observability import CoreMetrics, HostGauges, IndexMetrics, RpcMetrics
from hicached.server import credentials
from hicached.server.app import Server, claim_sockets
from hicached.server.fastlane import LaneServer, lane_path
from hicached.server.handoff import HandoffRegistry, HandoffServer, handoff_path
from hicached.server.lanes import Lanes
from hicached.server.peers import PeerSessions, UnreadAnswers
from hicached.server.roles import Access
from hicached.server.servicer import AdminServicer, CacheServicer, ServicerOptions
from hicached.shutdown import flush_within, rpc_grace_s
from hicached.startup import banner, budget_warnings, open_l3
from hicached.tasks import supervise
from hicached.transfer.engine import CopyEngine

logger = logging.getLogger(__name__)

# sys.setswitchinterval of the daemon process (see run_daemon).
LOOP_SWITCH_INTERVAL_S = 0.0005
# Sections whose keys SIGHUP applies to a running daemon.
RELOADABLE_SECTIONS = frozenset({"log"})


def attach_content_index(
    config: Config, state: GroupState, *, backend: StorageBackend | None, metrics: Metrics | None
) -> None:
    """Give a new pool group its content index (it registers as the group's reclaimer)."""
    l3 = config.l3
    observer: IndexObserver = (
        IndexMetrics(metrics, backend=l3.backend.value, page_size=state.group.anchor.host_pool.page_size)
        if metrics is not None
        else NullIndexObserver()
    )
    state.index = ContentIndex(
        state.group,
        namespace=f"hicached/{state.group_id}",
        backend=backend,
        options=IndexOptions(
            write_policy=l3.write_policy,
            io_workers=l3.io_workers,
            prefetch_timeout_base_s=l3.prefetch_timeout_base_s,
            prefetch_timeout_per_1k_tokens_s=l3.prefetch_timeout_per_1k_tokens_s,
        ),
        observer=observer,
        tenant_keys=state.tenant_keys,
        free_pages=state.free_from_index,
    )


class Daemon:
    """Everything one ``hicached serve`` runs, built from ``config``."""

    def __init__(self, config: Config, *, daemon_id: str | None = None) -> None:
        self.config = config
        # Before anything takes a resource: bad credentials and a socket another daemon
        # serves (or another user could swap) stop startup here, naming the cause.
        creds = credentials.load(config.server)
        l3_key = credentials.load_l3_key(config.l3)
        credentials.warn_readable(config.server, config.l3)
        admin_gid = claim_sockets(config)
        self.daemon_id = daemon_id or f"{os.getpid():x}{uuid.uuid4().hex[:4]}"
        self.metrics = Metrics()
        self._observe_rpc = RpcMetrics(self.metrics)
        self.backend = open_l3(config, l3_key)  # first: a backend that cannot start leaves nothing behind
        self.engine = CopyEngine(workers=config.copy.workers, max_queued_bytes=config.copy.max_queued)
        self.groups = _host_pools(config, self.daemon_id)
        self._core_metrics = CoreMetrics(self.metrics)
        self.core = HiCacheCore(
            config,
            groups=self.groups,
            engine=self.engine,
            attach_index=self._attach_index,
            observer=self._core_metrics,
        )
        self.keyed = KeyedCache(
            core=self.core,
            options=KeyedOptions.from_config(config),
            tag_key=l3_key.tenant_key if l3_key is not None else None,
        )
        self.lanes = Lanes.from_config(config)
        self.peers = PeerSessions(
            config.limits.max_sessions_per_peer,
            config.limits.max_buffer_bytes_per_peer,
            self.core.live_session_ids,
            mapping_limit=config.limits.max_mappings_per_peer,
        )
        self.answers = UnreadAnswers(config.limits.max_unread_answer_bytes_per_peer)
        self.l3_stats = (
            StatsCache(config.l3.backend.value, self.backend) if self.backend is not None else None
        )
        self.servicer_options = ServicerOptions(
            limits=config.limits,
            max_message_bytes=config.server.max_message_bytes,
            has_l3=self.backend is not None,
            l3_stats_wait_s=config.l3.stats_wait_s,
        )
        srv = config.server
        self.handoff = HandoffRegistry(
            ttl_s=srv.handoff_ticket_ttl_s,
            max_pending=srv.handoff_max_pending,
            max_per_uid=srv.handoff_max_pending_per_uid,
            max_fds_per_uid=srv.handoff_max_pending_fds_per_uid,
        )
        self.handoff_server = HandoffServer(
            self.handoff, handoff_path(srv.socket), mode=srv.socket_mode, max_fds=srv.handoff_max_fds
        )
        # The fast lane (docs/fastlane.md): same socket mode as gRPC, same checks per op.
        self.fast_lanes: LaneServer | None = None
        if srv.fast_lane:
            self.fast_lanes = LaneServer(
                self.core,
                self.keyed,
                lane_path(srv.socket),
                mode=srv.socket_mode,
                max_lanes=srv.fast_lane_max,
                max_per_session=srv.fast_lane_max_per_session,
                max_per_uid=srv.fast_lane_max_per_uid,
                limits=config.limits,
                observe=self._observe_rpc,
                on_failure=self._task_failed,
            )
        self.server = Server(
            config,
            self.core,
            self._registrations,
            credentials=creds,
            observe=self._observe_rpc,
            admin_gid=admin_gid,
        )
        self.metrics_server: MetricsServer | None = None
        self._gauges = HostGauges(
            self.metrics,
            self.groups,
            self.engine,
            self._core_metrics,
            backups=self.core.retraction_backups,
            l3_stats=self.l3_stats,
        )

    def _registrations(self, access: Access) -> list[Callable[[grpc.aio.Server], None]]:
        """The services of one listener, their servicers bound to its role."""
        shared = {
            "options": self.servicer_options,
            "access": access,
            "peers": self.peers,
            "answers": self.answers,
            "l3_stats": self.l3_stats,
        }
        cache = CacheServicer(self.core, self.lanes, keyed=self.keyed, handoff=self.handoff, **shared)
        admin = AdminServicer(
            self.core,
            self.lanes,
            keyed=self.keyed,
            **shared,
            on_drain=self.server.mark_draining,
            on_resume=self.server.mark_serving,
        )
        return [
            lambda s: pb_grpc.add_HiCacheServiceServicer_to_server(cache, s),  # type: ignore[no-untyped-call]
            lambda s: pb_grpc.add_AdminServiceServicer_to_server(admin, s),  # type: ignore[no-untyped-call]
        ]

    def _attach_index(self, state: GroupState) -> None:
        attach_content_index(self.config, state, backend=self.backend, metrics=self.metrics)

    def refresh_gauges(self) -> None:
        """Host usage and queue depths (cheap; the supervised `gauges` task calls it every second)."""
        self._gauges.refresh()

    async def start(self) -> None:
        await self.server.start()
        self.handoff_server.start()
        if self.fast_lanes is not None:
            self.fast_lanes.start()
        port, host = self.config.server.metrics_port, self.config.server.metrics_host
        url = None
        if port >= 0:
            try:
                self.metrics_server = serve_metrics(
                    self.metrics, host, port, on_failure=lambda: self._task_failed("metrics_http")
                )
            except OSError as exc:  # in use, or a host that does not resolve (gaierror)
                raise StartupError(
                    f"server.metrics_host/server.metrics_port {host}:{port} cannot serve metrics: "
                    f"{exc.strerror or exc}; pick a free port (0: any) or -1 to turn metrics off"
                ) from exc
            url = f"http://{host}:{self.metrics_server.port}/metrics"
        fields = banner(
            self.config,
            budget_bytes=self.groups.budget_bytes,
            metrics_url=url,
            tcp_port=self.server.tcp_port,
        )
        logger.info("hicached %s started", fields["version"], extra=fields)
        for warning in budget_warnings(self.groups.budget_bytes):
            logger.warning(warning, extra={"event": "config"})

    async def stop(self) -> None:
        """Stop serving, finish or cancel in-flight work, release every mapping and page.

        Every step runs even when one before it failed (a lane that could not stop must not
        skip the L3 flush and the journals): a failure is logged, and :class:`ShutdownFailed`
        is raised at the end naming the steps that failed. Call on the loop's thread.
        """
        budget = self.config.server.grace_s
        deadline = time.monotonic() + budget  # one budget for stop + flush (hicached/shutdown.py)
        loop = asyncio.get_running_loop()
        rpc_deadline = time.monotonic() + rpc_grace_s(budget)
        failed: list[str] = []

        async def step(name: str, run: Callable[[], object]) -> object:
            try:
                result = run()
                return await result if asyncio.isfuture(result) or asyncio.iscoroutine(result) else result
            except Exception:
                logger.exception("shutdown step %s failed; going on", name, extra={"event": "shutdown"})
                failed.append(name)
                return None

        await step("handoff", self.handoff_server.close)
        if self.fast_lanes is not None:  # each lane finishes the op it runs, then closes
            lanes = self.fast_lanes
            await step("fast lanes", lambda: loop.run_in_executor(None, lanes.close, rpc_grace_s(budget)))
        # Lanes and gRPC calls share the in-flight share of the one budget.
        await step("grpc", lambda: self.server.stop(max(0.0, rpc_deadline - time.monotonic())))
        await step("handoff tickets", self.handoff.close)
        indexes = self.keyed.indexes()
        flushed = await step("l3 flush", lambda: loop.run_in_executor(None, flush_within, indexes, deadline))
        logger.info("flushed pending L3 backups", extra={"event": "shutdown", "pages": flushed})
        # What is left of the budget (nothing, after a flush that used it all): sessions still
        # busy are torn down when their calls return; the journals are not held for them.
        await step(
            "close", lambda: loop.run_in_executor(None, self.close, max(0.0, deadline - time.monotonic()))
        )
        if failed:
            raise ShutdownFailed(f"shutdown steps failed: {', '.join(failed)} (see the log)")

    def close(self, wait_s: float | None = None) -> None:
        """Release everything (journals written under warm restart); every part is closed even
        when one before it fails, then :class:`ShutdownFailed` names those that failed.
        ``wait_s`` (default ``server.grace_s``) bounds the waits for lanes and sessions still
        busy, all of them together."""
        failed = []
        deadline = time.monotonic() + (self.config.server.grace_s if wait_s is None else wait_s)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        parts: list[tuple[str, Callable[[], object]]] = [("handoff tickets", self.handoff.close)]
        if self.fast_lanes is not None:
            lanes = self.fast_lanes
            parts.append(("fast lanes", lambda: lanes.close(left())))
        core = self.core
        parts += [("core", lambda: core.close(left())), ("engine", self.engine.close)]
        for name, part in (
            ("l3", self.backend),
            ("metrics", self.metrics_server),
            ("l3 stats", self.l3_stats),
        ):
            if part is not None:
                parts.append((name, part.close))
        parts.append(("lanes", self.lanes.shutdown))
        for name, close in parts:
            try:
                close()
            except Exception:
                logger.exception("closing %s failed; going on", name, extra={"event": "shutdown"})
                failed.append(name)
        if failed:
            raise ShutdownFailed(f"closing failed: {', '.join(failed)} (see the log)")

    def reload(self, fresh: Config) -> list[str]:
        """Apply the safe settings of a re-read configuration (SIGHUP); returns the keys applied.

        Only logging is reloadable; every other changed key is logged as needing a
        restart (pools, sockets and backends are built once).
        """
        applied = []
        old, new = as_dict(self.config), as_dict(fresh)
        for section, values in new.items():
            for key, value in _leaves(values):
                if _leaf(old[section], key) == value:
                    continue
                if section in RELOADABLE_SECTIONS:
                    applied.append(f"{section}.{key}")
                else:
                    secret = any(word in key for word in ("password", "secret"))
                    logger.warning(
                        "config change needs a restart",
                        extra={
                            "event": "reload",
                            "key": f"{section}.{key}",
                            "value": "***" if secret else value,
                        },
                    )
        if applied:
            setup_logging(fresh.log.level, fresh.log.format, fresh.log.max_rate)
            self.config = replace(self.config, log=fresh.log)
        logger.info("configuration reloaded", extra={"event": "reload", "applied": applied})
        return applied

    async def run(self, reload: Callable[[], Config] | None = None, early: EarlySignals | None = None) -> int:
        """Serve until SIGTERM/SIGINT (SIGHUP re-reads the config); 0 after a clean shutdown,
        1 when a shutdown step failed (each is logged; every later step still ran).

        ``early``: the signals that arrived while the daemon was being built (see
        :func:`run_daemon`); a stop among them is honoured right after start, a SIGHUP
        re-reads the config then. A start that fails stops what it started (its sockets
        are unlinked) and re-raises.
        """
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if reload is not None:
            loop.add_signal_handler(signal.SIGHUP, lambda: self._on_sighup(reload))
        try:
            await self.start()
        except BaseException:
            with contextlib.suppress(ShutdownFailed):  # logged step by step; the cause is raised
                await self.stop()
            raise
        if early is not None and early.stop:
            logger.info("stop requested during start", extra={"event": "shutdown"})
            stop.set()
        if early is not None and early.reload and reload is not None:
            self._on_sighup(reload)
        on_failure = self._task_failed
        srv = self.config.server
        periodic: list[tuple[str, Callable[[], Awaitable[None] | None], float]] = [
            # Ends sessions (and backups) past their lease, on the bookkeeping lane (never
            # shared with copies or L3 calls); a lease of min_lease_ms is seen within a quarter.
            ("lease_reaper", self._reap, max(0.05, min(1.0, self.config.sessions.min_lease_ms / 4000))),
            ("gauges", self.refresh_gauges, 1.0),
            # Closes the fds of expired fd-handoff tickets even when nobody hands over or attaches.
            ("handoff_sweep", self._sweep_handoffs, max(0.05, srv.handoff_ticket_ttl_s / 4)),
        ]
        if self.l3_stats is not None:
            periodic.append(("l3_stats", self.l3_stats.step, self.config.l3.stats_interval_s))
        tasks = [
            asyncio.create_task(supervise(name, step, interval_s=interval, on_failure=on_failure))
            for name, step, interval in periodic
        ]
        await stop.wait()
        logger.info("shutting down", extra={"event": "shutdown"})
        for task in tasks:
            task.cancel()
        try:
            await self.stop()
        except ShutdownFailed as exc:
            logger.error("%s", exc, extra={"event": "shutdown"})
            return 1
        return 0

    async def _reap(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.lanes.bookkeeping.executor, self.core.expire)

    def _sweep_handoffs(self) -> None:
        self.handoff.expire()

    def _task_failed(self, task: str) -> None:
        self.metrics.task_failures.labels(task=self.metrics.task(task)).inc()

    def _on_sighup(self, reload: Callable[[], Config]) -> None:
        try:
            self.reload(reload())
        except ConfigError as exc:
            logger.error("config reload rejected: %s", exc, extra={"event": "reload"})
        except Exception:  # a bug: said as such, and the daemon goes on with the config it has
            logger.exception(
                "config reload failed; the running configuration stays", extra={"event": "reload"}
            )


def _leaves(values: dict[str, object], prefix: str = "") -> list[tuple[str, object]]:
    """``{"redis": {"host": h}}`` -> ``[("redis.host", h)]`` (backend tables are nested)."""
    out: list[tuple[str, object]] = []
    for key, value in values.items():
        if isinstance(value, dict):
            out.extend(_leaves(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _leaf(values: dict[str, object], dotted: str) -> object:
    node: object = values
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


class ShutdownFailed(Exception):
    """A step of :meth:`Daemon.stop` / :meth:`Daemon.close` failed (each is logged with its
    traceback); the steps after it ran."""


class EarlySignals:
    """SIGTERM/SIGINT/SIGHUP that arrive while the daemon is being built, before its event
    loop handles them: building takes a while (an L3 directory's index rebuild) and until
    now the default action killed the daemon with no cleanup. The handlers only set flags
    (they run on the main thread between bytecodes); :meth:`Daemon.run` reads them."""

    def __init__(self) -> None:
        self.stop = False
        self.reload = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)

    def _on_stop(self, *_: object) -> None:  # (signum, frame)
        self.stop = True

    def _on_reload(self, *_: object) -> None:
        self.reload = True


def run_daemon(config: Config, reload: Callable[[], Config] | None = None) -> int:
    """Build and serve a daemon; a :class:`~hicached.errors.StartupError` propagates (exit 2)."""
    import uvloop

    # The event loop thread gives the GIL up at every I/O call; with a CPU-bound lane thread
    # (hashing, index walks) it waits a whole switch interval to get it back each time, so a
    # heartbeat that needs it a dozen times would take ~100 ms at the 5 ms default.
    sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)
    early = EarlySignals()
    early.install()  # before anything is claimed; the loop's own handlers replace these
    daemon = Daemon(config)
    return uvloop.run(daemon.run(reload, early))


def _host_pools(config: Config, daemon_id: str) -> GroupRegistry:
    """The pool groups' registry; a journal directory, prefix or /dev/shm that cannot be used
    is a :class:`StartupError` (one line naming the key), not a traceback."""
    try:
        return GroupRegistry(config.host, daemon_id=daemon_id, max_key_bytes=config.limits.max_key_bytes)
    except FailedPrecondition as exc:
        message = str(exc)
        if "host." not in message:
            message += f" [host.shm_prefix = {config.host.shm_prefix!r}]"
        raise StartupError(f"host pools cannot start: {message}") from exc
