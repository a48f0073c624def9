"""What ``hicached serve`` says and checks at start: the L3 backend opened with a one-line
error naming the key to fix, and the startup banner.

:class:`StartupError` is an expected failure (the command prints its message as one
line and exits 2, no traceback). Pure functions apart from opening the backend.
"""

from __future__ import annotations

import os
from typing import Any

from hicached import __version__
from hicached.coerce import format_size
from hicached.config import Config, default_cache_dir
from hicached.errors import HiCacheError, StartupError
from hicached.l3.base import StorageBackend
from hicached.l3.framing import FrameCodec, L3Key
from hicached.l3.registry import L3Backend, fix_keys, open_backend, takes_frames
from hicached.shm import SHM_DIR

__all__ = ["banner", "l3_auth", "l3_source", "l3_target", "open_l3"]


def l3_target(config: Config) -> str:
    """Where the configured backend keeps its pages (its options' ``target()``), for the
    banner and errors."""
    options: Any = config.l3.backend_config()
    return "none" if options is None else str(options.target())


def l3_source(config: Config) -> str:
    """Where the L3 location came from: a configured key, or the default and what it derives from.

    The file backend's default path follows XDG_CACHE_HOME, else the user's home (root:
    /var/cache); in a container whose user has no home (HOME=/nonexistent) that default is
    useless, so the startup line and the error say which variable it came from.
    """
    backend = config.l3.backend
    if backend is not L3Backend.FILE:
        return f"[l3.{backend}]" if backend is not L3Backend.NONE else "l3.backend"
    if config.l3.file.path != str(default_cache_dir() / "l3"):
        return "l3.file.path"
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return f"default $XDG_CACHE_HOME/hicached/l3 (XDG_CACHE_HOME={xdg}); set l3.file.path to change it"
    if os.geteuid() == 0:
        return "default for root (/var/cache/hicached/l3); set l3.file.path to change it"
    home = os.environ.get("HOME", "")
    return f"default $HOME/.cache/hicached/l3 (HOME={home or '(unset)'}); set l3.file.path to change it"


def l3_auth(config: Config) -> str:
    """Who can put pages into the configured L3 that the daemon serves, for the banner."""
    name = config.l3.backend
    if name is L3Backend.NONE:
        return "none"
    if not takes_frames(name):  # the file backend: a directory only the daemon's user writes
        return "file permissions"
    if config.l3.auth_key_file:
        return "hmac (holders of l3.auth_key_file)"
    return "off (every writer of the L3, for every tenant; set l3.auth_key_file)"


def open_l3(config: Config, key: L3Key | None = None) -> StorageBackend | None:
    """The configured L3 backend (None for ``l3.backend = "none"``); the caller owns it.

    ``key`` (from ``l3.auth_key_file``): a backend that stores frames (redis, s3, mooncake)
    writes and accepts only frames authenticated with it; the file backend does not take
    it (its directory's permissions are its trust). A backend that cannot start (missing
    package, unreachable server, unwritable or busy directory, bad bucket) raises
    :class:`StartupError` naming the key to fix.
    """
    name = config.l3.backend
    if name is L3Backend.NONE:
        return None
    options = config.l3.backend_config()
    try:
        codec = FrameCodec(key.frame_key) if key is not None and takes_frames(name) else None
        return open_backend(name, options, codec=codec)
    except (HiCacheError, OSError) as exc:
        reason = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise StartupError(
            f"L3 backend '{name.value}' at {l3_target(config)} ({l3_source(config)}) cannot start: "
            f"{reason.rstrip('.')}. "
            f'Fix {fix_keys(name)}, or run without L3 (l3.backend = "none").'
        ) from exc


def budget_warnings(budget_bytes: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Warnings when the host budget exceeds the machine's memory or the size of the
    filesystem the host pools live in: the daemon starts (the budget is a cap, nothing is
    taken yet), but attaches fail once the pools outgrow either, far from this cause."""
    limits = [("the machine's memory", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))]
    try:
        st = os.statvfs(shm_dir)
        limits.append((f"{shm_dir} (its size)", st.f_blocks * st.f_frsize))
    except OSError:  # no such filesystem here: nothing to compare with
        pass
    return [
        f"host budget {format_size(budget_bytes)} is larger than {what}, {format_size(limit)}: "
        "host pools fail to grow past it; lower host.budget (--host-budget) or host.budget_fraction"
        for what, limit in limits
        if 0 < limit < budget_bytes
    ]


def _budget_source(config: Config) -> str:
    host = config.host
    if host.budget > 0:
        return "host.budget"
    return f"host.budget_fraction={host.budget_fraction} of available memory"


def banner(
    config: Config, *, budget_bytes: int, metrics_url: str | None, tcp_port: int | None
) -> dict[str, Any]:
    """The fields of the one structured startup line (no secrets: only whether auth/TLS are on)."""
    server = config.server
    tcp = "off"
    if server.listen:
        host = server.listen.rpartition(":")[0]
        address = f"{host}:{tcp_port}" if tcp_port else server.listen
        auth = "token" if server.auth_token_file else "none"
        tls = "mtls" if server.tls_client_ca else "on" if server.tls_cert else "off"
        tcp = f"{address} auth={auth} tls={tls}"
    fields: dict[str, Any] = {
        "event": "started",
        "version": __version__,
        "pid": os.getpid(),
        "socket": str(server.socket),
        "tcp": tcp,
        "metrics": metrics_url or "off",
        "host_budget_bytes": budget_bytes,
        "host_budget": f"{format_size(budget_bytes)} from {_budget_source(config)}",
        "l3": config.l3.backend.value,
        "l3_target": l3_target(config),
        "l3_source": l3_source(config),
        "l3_auth": l3_auth(config),
        "warm_restart": f"on (journals in {config.host.journal_dir})" if config.host.warm_restart else "off",
    }
    if config.l3.backend is L3Backend.FILE:
        fields["l3_capacity_bytes"] = config.l3.file.capacity_bytes
    return fields
