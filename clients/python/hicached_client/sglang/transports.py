"""How one pool link's pages move between SGLang's host pool and the daemon.

:class:`ShmTransport` stages pages through a shared staging area the daemon maps (one copy
in SGLang's process each way); :class:`BytesTransport` sends them inside PutBytes / GetBytes
messages (no shared memory); :class:`ZeroCopyTransport` names host page numbers of a pool the
daemon maps itself (no copy here), with the byte path for the generic API's flat pages.
:class:`~hicached_client.sglang.link.PoolLink` picks one and cuts SGLang's batches to its
``capacity``.

Thread-safety and ownership as each class says; a transport never outlives its link's session.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence

import grpc
import torch

from hicached_client.errors import HiCacheError
from hicached_client.sglang.config import AdapterConfig
from hicached_client.sglang.layouts import PoolBinding
from hicached_client.sglang.staging import StagingArea
from hicached_client.sync import Session
from hicached_client.types import PageBytes
from hicached_client.types import Transfer as WireTransfer

# The daemon's name for the single pool of every adapter session.
DAEMON_POOL = "kv"

Fill = Callable[[torch.Tensor], None]
Drain = Callable[[torch.Tensor], None]


class PageTransport(abc.ABC):
    """Moves one batch (at most ``capacity`` pages) between chunk tensors and the daemon.

    ``put`` calls ``fill(out)`` with a ``(groups, n, chunk_bytes)`` tensor to
    fill, then stores it, returning None, or the daemon's reason when it
    refused the write (no room, over budget: nothing stored); ``get`` loads the leading run of hits and calls
    ``drain(src)`` with a ``(groups, hits, chunk_bytes)`` tensor. Thread-safe.
    """

    capacity: int

    @abc.abstractmethod
    def put(self, keys: Sequence[str], fill: Fill) -> str | None: ...

    @abc.abstractmethod
    def get(self, keys: Sequence[str], drain: Drain) -> int: ...


class ShmTransport(PageTransport):
    """Pages cross through the staging area; messages carry page indices only."""

    def __init__(self, session: Session, staging: StagingArea, config: AdapterConfig) -> None:
        self._session = session
        self._staging = staging
        self._tenant = config.tenant
        self._include_l3 = config.include_l3
        self.capacity = staging.half
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Free the staging area once no put or get of this transport uses it (a link that
        attached again closes its old transport while other threads may still hold it)."""
        with self._write_lock, self._read_lock:
            self._closed = True
            self._staging.close()

    def _check_open(self) -> None:
        if self._closed:  # replaced: NOT_FOUND makes the link run the call on the new one
            raise HiCacheError(grpc.StatusCode.NOT_FOUND, "the staging area was replaced by a new session's")

    def put(self, keys: Sequence[str], fill: Fill) -> str | None:
        n = len(keys)
        with self._write_lock:
            self._check_open()
            fill(self._staging.write_half()[:, :n])
            pages = list(self._staging.write_pages[:n])
            result = self._session.put_pages(keys, [WireTransfer(DAEMON_POOL, pages)], tenant=self._tenant)
        return None if result.ok else result.reason

    def get(self, keys: Sequence[str], drain: Drain) -> int:
        n = len(keys)
        with self._read_lock:
            self._check_open()
            pages = list(self._staging.read_pages[:n])
            result = self._session.get_pages(
                keys, [WireTransfer(DAEMON_POOL, pages)], include_l3=self._include_l3, tenant=self._tenant
            )
            hits = min(result.hit_pages, n)
            if hits:
                drain(self._staging.read_half()[:, :hits])
        return hits


# A GetBytes answer carries its pages' bytes, and the daemon refuses one past its
# limits.max_response_bytes (32 MiB by default) however many it holds: a byte-path batch keeps
# to half of that (128 pages of 1 MiB were refused whole, so such pages never read back).
BYTES_PER_CALL = 16 << 20


class BytesTransport(PageTransport):
    """Fallback: page bytes inside PutBytes / GetBytes messages (no shared memory)."""

    def __init__(self, session: Session, binding: PoolBinding, config: AdapterConfig) -> None:
        self._session = session
        self._geometry = binding.geometry
        self._tenant = config.tenant
        self._include_l3 = config.include_l3
        page_bytes = binding.geometry.groups * binding.geometry.chunk_bytes
        self.capacity = max(1, min(config.staging_pages, BYTES_PER_CALL // page_bytes))

    def put(self, keys: Sequence[str], fill: Fill) -> str | None:
        g = self._geometry
        chunks = torch.empty((g.groups, len(keys), g.chunk_bytes), dtype=torch.uint8)
        fill(chunks)
        pages = chunks.permute(1, 0, 2).contiguous().numpy()
        try:
            self._session.put_bytes(
                [PageBytes(key, DAEMON_POOL, pages[i].tobytes()) for i, key in enumerate(keys)],
                tenant=self._tenant,
            )
        except HiCacheError as exc:
            # PutBytes refuses with RESOURCE_EXHAUSTED, the reason in the message.
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return exc.message
        return None

    def get(self, keys: Sequence[str], drain: Drain) -> int:
        g = self._geometry
        result = self._session.get_bytes(keys, include_l3=self._include_l3, tenant=self._tenant)
        # The leading run of pages that are what was asked for: the key, one whole page each.
        size, hits = g.groups * g.chunk_bytes, 0
        for page, key in zip(result.pages[: min(result.hit_pages, len(keys))], keys, strict=False):
            if page.key != key or len(page.data) != size:
                break
            hits += 1
        if hits:
            flat = torch.frombuffer(
                bytearray(b"".join(p.data for p in result.pages[:hits])), dtype=torch.uint8
            )
            drain(flat.view(hits, g.groups, g.chunk_bytes).permute(1, 0, 2))
        return hits


class ZeroCopyTransport(BytesTransport):
    """The daemon maps the host pool itself: page batches name host page numbers.

    ``put_host`` / ``get_host`` move pages with no copy in this process;
    ``put`` / ``get`` (flat pages of the generic API, which are not in the host
    pool) are the byte path inherited from :class:`BytesTransport`.
    """

    def __init__(self, session: Session, binding: PoolBinding, config: AdapterConfig) -> None:
        super().__init__(session, binding, config)
        # Its batches carry page numbers, not bytes: up to staging_pages, as SGLang's batch.
        self.host_capacity = config.staging_pages

    def put_host(self, keys: Sequence[str], host_pages: Sequence[int]) -> str | None:
        result = self._session.put_pages(
            keys, [WireTransfer(DAEMON_POOL, list(host_pages))], tenant=self._tenant
        )
        return None if result.ok else result.reason

    def get_host(self, keys: Sequence[str], host_pages: Sequence[int]) -> int:
        result = self._session.get_pages(
            keys,
            [WireTransfer(DAEMON_POOL, list(host_pages))],
            include_l3=self._include_l3,
            tenant=self._tenant,
        )
        return min(result.hit_pages, len(keys))


def answer_too_large(exc: HiCacheError) -> bool:
    """The daemon refused an answer for its size (a configured limit), not its content."""
    limits = ("limits.max_response_bytes", "server.max_message_bytes")
    return exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and any(key in exc.message for key in limits)


def as_zero_copy(transport: PageTransport) -> ZeroCopyTransport:
    """``transport`` as the zero-copy one (a re-attach keeps the path it was decided with)."""
    if not isinstance(transport, ZeroCopyTransport):
        raise HiCacheError(grpc.StatusCode.FAILED_PRECONDITION, "pool link lost its zero-copy path")
    return transport


__all__ = [
    "BYTES_PER_CALL",
    "DAEMON_POOL",
    "BytesTransport",
    "Drain",
    "Fill",
    "PageTransport",
    "ShmTransport",
    "ZeroCopyTransport",
    "answer_too_large",
    "as_zero_copy",
]
