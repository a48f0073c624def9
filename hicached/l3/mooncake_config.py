"""Options of the ``mooncake`` L3 backend (:mod:`hicached.l3.mooncake`), checked when they are built."""

from __future__ import annotations

import dataclasses

from hicached.coerce import option, parse_size, typed_fields
from hicached.errors import InvalidArgument, clip

__all__ = ["MooncakeBackendConfig"]

_PROTOCOLS = ("tcp", "rdma")


@dataclasses.dataclass(frozen=True)
class MooncakeBackendConfig:
    """Options of the ``mooncake`` backend.

    ``master_addr``: ``host:port`` of ``mooncake_master`` (required).
    ``metadata_server``: transfer-engine metadata; ``P2PHANDSHAKE`` needs no
    etcd/HTTP server. ``local_hostname``: the address other clients use to
    reach this one. ``protocol``: ``tcp`` or ``rdma`` (``rdma_devices`` then
    names the NICs). ``global_segment_bytes``: memory this process lends to
    the cluster (0: store only into other processes' segments).
    ``local_buffer_bytes``: the client's own transfer buffer (used by ``get``).
    ``staging_bytes``: the registered buffer for batched ``set``/``get_into``;
    one page frame (32-byte header + page) must fit. ``replicas``: copies per
    page. ``key_prefix``: prepended to every object key (empty: this backend
    shares the whole cluster namespace, and ``clear("")`` empties it).
    ``connect_timeout_s``: the master must accept a TCP connection within
    this time at start (the Mooncake client itself retries for ~90 s).
    """

    master_addr: str = option(help="host:port of mooncake_master.")
    metadata_server: str = option(
        "P2PHANDSHAKE", help="Transfer-engine metadata (P2PHANDSHAKE needs no server)."
    )
    local_hostname: str = option("127.0.0.1", help="Address other Mooncake clients use to reach this one.")
    protocol: str = option("tcp", help="tcp or rdma.")
    rdma_devices: str = option("", help="RDMA NICs (protocol = rdma).")
    global_segment_bytes: int = option(
        0, help="Memory this daemon lends to the store (0 = store into others' segments).", parse=parse_size
    )
    local_buffer_bytes: int = option(64 << 20, help="The client's own transfer buffer.", parse=parse_size)
    staging_bytes: int = option(
        64 << 20, help="Registered buffer for batched set/get; one page frame must fit.", parse=parse_size
    )
    replicas: int = option(1, help="Copies per page.")
    key_prefix: str = option("hicached/", help="Prepended to every object key.")
    connect_timeout_s: float = option(5.0, help="Seconds the master has to accept a connection at start.")

    def target(self) -> str:
        """Where the pages are, for the startup line and errors."""
        return f"master {self.master_addr}"

    def __post_init__(self) -> None:
        typed_fields(self, "l3.mooncake")  # a config built in Python is checked as a file's
        host, sep, port = self.master_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(
                f"mooncake backend option 'master_addr' must be host:port, got {clip(self.master_addr)}"
            )
        if not self.metadata_server or not self.local_hostname:
            raise InvalidArgument(
                "mooncake backend options 'metadata_server' and 'local_hostname' must be non-empty, "
                f"got {clip(self.metadata_server)} and {clip(self.local_hostname)}"
            )
        if self.protocol not in _PROTOCOLS:
            raise InvalidArgument(
                f"mooncake backend option 'protocol' must be one of {', '.join(_PROTOCOLS)}, "
                f"got {clip(self.protocol)}"
            )
        for opt in ("global_segment_bytes", "local_buffer_bytes"):
            if getattr(self, opt) < 0:
                value = getattr(self, opt)
                raise InvalidArgument(f"mooncake backend opt {opt!r} must be >= 0, got {clip(value)}")
        if self.staging_bytes < 4096:
            raise InvalidArgument(
                f"mooncake backend opt 'staging_bytes' must be >= 4096, got {clip(self.staging_bytes)}"
            )
        if self.replicas < 1:
            raise InvalidArgument(f"mooncake backend opt 'replicas' must be >= 1, got {clip(self.replicas)}")
        if not self.connect_timeout_s > 0:
            raise InvalidArgument(
                f"mooncake backend opt 'connect_timeout_s' must be > 0, got {clip(self.connect_timeout_s)}"
            )
