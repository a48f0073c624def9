"""The adapter's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands every key of that JSON object to the backend as
``HiCacheStorageConfig.extra_config``; its own keys (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``, ``allocator``, ...) sit beside
ours. Ours live in one nested object under ``"hicached"`` so that a typo there
is an error instead of a silently ignored key::

    {"backend_name": "hicached", "module_path": "hicached_client.sglang",
     "class_name": "HiCachedStorage", "interface_v1": 1,
     "hicached": {"target": "unix:///run/hicached/hicached.sock", "tenant": "team-a"}}

Pure and immutable; thread-safe.
"""

from __future__ import annotations

import enum
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from hicached_client._channel import default_target

EXTRA_CONFIG_KEY = "hicached"
# SGLang's own batch size for storage I/O (hicache_storage.STORAGE_BATCH_SIZE).
DEFAULT_STAGING_PAGES = 128
# Per direction: bounds the staging area for models with large pages.
DEFAULT_STAGING_BYTES = 64 << 20
# L2 of the byte-path pool group (tensors stored by key when no host pool fits).
DEFAULT_BLOB_HOST_BYTES = 16 << 20


class Transport(enum.StrEnum):
    """How page bytes reach the daemon."""

    # Pages are staged in a shared-memory "device" pool the daemon has mapped;
    # messages carry page indices only (one in-process copy per direction).
    SHM = "shm"
    # Pages travel inside PutBytes / GetBytes messages (for daemons that cannot
    # map this process's shared memory). Slower; an explicit choice only.
    BYTES = "bytes"


@dataclass(frozen=True)
class AdapterConfig:
    """Validated adapter settings (see the module docstring for where they come from).

    ``target``: gRPC target of the daemon. ``tenant``: tenant label; pages of
    different tenants never hit each other and ``clear()`` drops only this
    tenant. ``staging_pages``: pages per daemon call (the shared staging area
    holds twice that: one half for writes, one for reads), at most
    ``staging_bytes`` per half (but at least one page). ``host_bytes``: the
    daemon-side L2 size asked for each pool group (0 = the size of SGLang's own
    host pool). ``blob_host_bytes``: the L2 size asked for the group that holds
    tensors stored by key when no registered host pool fits them. ``include_l3``:
    reads and existence checks also consult the daemon's L3. ``fast_lane``: page
    calls and hit queries (GetPages/PutPages/Lookup) go over the daemon's fast
    lane when it offers one (Unix-socket targets), falling back to gRPC.
    ``instance_id``: names this worker's slots in the daemon (default: host, pid
    and a random suffix, so two processes never collide).
    """

    target: str
    tenant: str = ""
    token: str | None = field(default=None, repr=False)  # a credential: never in a log line
    transport: Transport = Transport.SHM
    staging_pages: int = DEFAULT_STAGING_PAGES
    staging_bytes: int = DEFAULT_STAGING_BYTES
    host_bytes: int = 0
    blob_host_bytes: int = DEFAULT_BLOB_HOST_BYTES
    include_l3: bool = True
    lease_ms: int = 0
    timeout_s: float = 30.0
    fast_lane: bool = True
    instance_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"hicached.target must be a non-empty string, got {self.target!r}")
        if not isinstance(self.tenant, str):
            raise ValueError(f"hicached.tenant must be a string, got {self.tenant!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ValueError("hicached.token must be a non-empty string when given")
        _check_int("staging_pages", self.staging_pages, minimum=1)
        _check_int("staging_bytes", self.staging_bytes, minimum=1)
        _check_int("host_bytes", self.host_bytes, minimum=0)
        _check_int("blob_host_bytes", self.blob_host_bytes, minimum=1)
        _check_int("lease_ms", self.lease_ms, minimum=0)
        for flag in ("include_l3", "fast_lane"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"hicached.{flag} must be true or false, got {getattr(self, flag)!r}")
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or self.timeout_s <= 0
        ):
            raise ValueError(f"hicached.timeout_s must be a positive number, got {self.timeout_s!r}")
        if not isinstance(self.instance_id, str):
            raise ValueError(f"hicached.instance_id must be a string, got {self.instance_id!r}")

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None) -> AdapterConfig:
        """Read the ``"hicached"`` object of SGLang's extra config (absent = all defaults).

        ValueError naming the key for an unknown key or a bad value.
        """
        raw = (extra_config or {}).get(EXTRA_CONFIG_KEY, {})
        if not isinstance(raw, Mapping):
            raise ValueError(f"extra_config[{EXTRA_CONFIG_KEY!r}] must be a JSON object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown hicached option(s) {unknown}; known: {sorted(known)}")
        values = dict(raw)
        values.setdefault("target", default_target())
        if "transport" in values:
            try:
                values["transport"] = Transport(values["transport"])
            except ValueError:
                raise ValueError(
                    f"hicached.transport must be one of {[t.value for t in Transport]}, "
                    f"got {values['transport']!r}"
                ) from None
        config = cls(**values)
        if not config.instance_id:
            config = _with_instance_id(config)
        return config


def _with_instance_id(config: AdapterConfig) -> AdapterConfig:
    instance = f"sglang-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    values = {f.name: getattr(config, f.name) for f in fields(config)}
    values["instance_id"] = instance
    return AdapterConfig(**values)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"hicached.{name} must be an integer >= {minimum}, got {value!r}")
