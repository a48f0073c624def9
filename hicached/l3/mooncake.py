"""The ``mooncake`` L3 backend: pages in a Mooncake Store cluster (TCP or RDMA).

Mooncake Store keeps objects in memory *segments* that clients mount into the
cluster; a ``mooncake_master`` holds the metadata. This backend is a client:
with ``global_segment_bytes=0`` it stores into segments that other processes
(``mooncake_client`` sidecars, other nodes) contribute, so pages outlive the
daemon; with a positive size it also contributes that much of its own memory
(those pages go away when the backend closes).

Object layout. Page ``key`` is the object ``<key_prefix><key>`` whose value is
one self-verifying frame from :mod:`hicached.l3.framing` (with
``l3.auth_key_file``, authenticated by an HMAC of key and payload; without it,
every writer of the cluster is trusted with every page). ``key_prefix``
(default ``hicached/``) keeps this daemon's pages apart from other users of
the same cluster, so ``clear("")`` removes only ours.

Data path. ``set``/``set_from``/``get_into`` stage frames in one buffer that
is registered with the transfer engine once (``staging_bytes``), and move a
whole batch with ``batch_put_from``/``batch_get_into`` (per-key results; a
batch larger than the buffer goes in several rounds). ``get`` uses
``get_batch``. Every frame is verified before it is served; a corrupt page is
a miss, counted and removed so it can be stored again. A key that already
exists is skipped without being sent (one ``batch_is_exist`` per batch).

Removal uses ``force=True``: Mooncake otherwise refuses to remove an object
for its read lease (10 s by default) after any read. A reader on another node
racing a forced removal can read freed memory; its frame check turns that
into a miss, never wrong KV.

Counters. Mooncake has no listing API, so ``stats().pages``/``bytes`` count
what this client stored and has not removed; pages that other clients wrote
or that Mooncake evicted under memory pressure are not reflected.

Thread-safety: the Mooncake client is thread-safe; the staging buffer is
guarded by a lock (one staged batch at a time per backend), counters by
another. ``close()`` waits for every call in flight (the native client crashes
the process when it is closed under one), unregisters and frees the buffer
exactly once, and closes the client. Idempotent.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np

from hicached.errors import InvalidArgument, Unavailable, clip
from hicached.l3.base import BackendStats, ReadCounters, StorageBackend, check_batch, chunks_nbytes
from hicached.l3.framing import PLAIN, FrameCodec
from hicached.l3.mooncake_config import MooncakeBackendConfig
from hicached.l3.registry import L3Backend, register_backend

__all__ = ["MooncakeBackend", "MooncakeBackendConfig"]

log = logging.getLogger(__name__)

_INSTALL_HINT = (
    "the mooncake backend needs Mooncake Store: pip install 'hicached[mooncake]' "
    "(and the Debian package libibverbs1)"
)
_OBJECT_NOT_FOUND = -704
# A key no page has (pages are content keys): its existence query tells whether the master answers.
_PROBE_KEY = ".hicached-probe"
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")
_Buffer = bytes | bytearray | memoryview


def _regex_literal(text: str) -> str:
    """``text`` as a literal for the master's (ECMAScript) regex engine."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def _flat(chunk: _Buffer) -> memoryview:
    view = memoryview(chunk)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@register_backend(L3Backend.MOONCAKE, MooncakeBackendConfig, framed=True, fix_keys="l3.mooncake.master_addr")
class MooncakeBackend(StorageBackend):
    """Pages as framed objects in Mooncake Store; see the module docstring."""

    name = "mooncake"

    def __init__(self, config: MooncakeBackendConfig, *, codec: FrameCodec = PLAIN) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise InvalidArgument(f"{_INSTALL_HINT}: {exc}") from exc
        self.config = config
        self._codec = codec
        self._header = codec.header_size
        self._lock = threading.Lock()  # page/byte counts, frame hint, closed flag, calls in flight
        self._idle = threading.Condition(self._lock)
        self._users = 0  # calls into the store outside the staging lock
        self._staging_lock = threading.Lock()
        self._pages = self._bytes = 0
        self._reads = ReadCounters()
        self._closed = False
        self._frame_hint = self._header + (64 << 10)  # largest frame seen; sizes get()'s slots
        self._replicate: Any = ReplicateConfig()
        self._replicate.replica_num = config.replicas
        host, _, port = config.master_addr.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), config.connect_timeout_s).close()
        except OSError as exc:
            raise Unavailable(f"mooncake master {config.master_addr!r} is unreachable: {exc}") from exc
        self._store: Any = MooncakeDistributedStore()
        rc = self._store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            config.rdma_devices,
            config.master_addr,
        )
        if rc != 0:
            self._store.close()
            raise Unavailable(
                f"mooncake client setup against master {config.master_addr!r} failed (code {rc})"
            )
        # Filled once so the first batch does not pay page faults.
        self._staging: np.ndarray[Any, np.dtype[np.uint8]] | None = np.zeros(config.staging_bytes, np.uint8)
        self._staging_addr = int(self._staging.ctypes.data)
        self._staging_view = self._staging.data
        rc = self._store.register_buffer(self._staging_addr, config.staging_bytes)
        if rc != 0:
            self._staging_view.release()
            self._staging = None
            self._store.close()
            raise Unavailable(f"mooncake could not register the {config.staging_bytes}-byte staging buffer")

    # ---------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable(f"mooncake backend (master {self.config.master_addr}) is closed")

    @contextlib.contextmanager
    def _using(self) -> Iterator[Any]:
        """The store, for one call outside the staging lock; close() waits for it."""
        with self._lock:
            self._check_open()
            self._users += 1
        try:
            yield self._store
        finally:
            with self._lock:
                self._users -= 1
                if not self._users:
                    self._idle.notify_all()

    def _object_keys(self, keys: Sequence[str]) -> list[str]:
        for key in keys:
            if not isinstance(key, str) or not key:
                raise InvalidArgument(f"storage key must be a non-empty str, got {key!r}")
        self._check_open()
        return [self.config.key_prefix + key for key in keys]

    def _check_fits(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        limit = self.config.staging_bytes - self._header
        for key, size in zip(keys, sizes, strict=True):
            if size > limit:
                raise InvalidArgument(
                    f"page {clip(key)} of {size} bytes does not fit the mooncake staging buffer "
                    f"(staging_bytes={self.config.staging_bytes}; a page may be at most {limit} bytes)"
                )

    def _rounds(self, frame_sizes: Sequence[int]) -> list[range]:
        """Consecutive index ranges whose frames fit the staging buffer together."""
        rounds: list[range] = []
        start = used = 0
        for i, size in enumerate(frame_sizes):
            if used + size > self.config.staging_bytes:
                rounds.append(range(start, i))
                start, used = i, 0
            used += size
        if start < len(frame_sizes):
            rounds.append(range(start, len(frame_sizes)))
        return rounds

    def _drop_corrupt(self, key: str, object_key: str, why: str) -> None:
        log.warning("mooncake backend: page %r failed verification (%s); removing it", key, why)
        self._reads.corrupt()
        rc = self._store.remove(object_key, True)
        if rc not in (0, _OBJECT_NOT_FOUND):
            log.warning("mooncake backend: could not remove corrupt %r (code %s)", key, rc)

    # ------------------------------------------------------------- interface

    def exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        names = self._object_keys(keys)
        with self._using() as store:
            found = store.batch_is_exist(names)
        count = 0
        for flag in found:
            if flag != 1:
                break
            count += 1
        return count

    def present(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._using() as store:
            found = store.batch_is_exist(self._object_keys(keys))
        return [flag == 1 for flag in found]

    def _read_staged(
        self,
        keys: Sequence[str],
        names: Sequence[str],
        slots: Sequence[int],
        deliver: Callable[[int, memoryview], bool],
    ) -> list[int]:
        """Read frame ``i`` into a staging slot of ``slots[i]`` bytes and hand its
        verified payload to ``deliver(i, payload)`` (under the staging lock: the
        view dies with it). Returns per key: 1 delivered, 0 refused by ``deliver``
        or missing or corrupt, -1 the frame did not fit its slot."""
        status = [0] * len(keys)
        with self._staging_lock:
            self._check_open()
            for part in self._rounds(slots):
                offsets, at = [], 0
                for i in part:
                    offsets.append(at)
                    at += slots[i]
                got = self._store.batch_get_into(
                    [names[i] for i in part],
                    [self._staging_addr + o for o in offsets],
                    [slots[i] for i in part],
                )
                for i, offset, rc in zip(part, offsets, got, strict=True):
                    if rc < 0:
                        status[i] = 0 if rc == _OBJECT_NOT_FOUND else -1
                        continue
                    payload, why = self._codec.verify(keys[i], self._staging_view[offset : offset + rc])
                    if payload is None:
                        self._drop_corrupt(keys[i], names[i], why)
                    elif deliver(i, payload):
                        status[i] = 1
        return status

    @staticmethod
    def _keep_at(pages: list[bytes | None], i: int, _index: int, payload: memoryview) -> bool:
        pages[i] = bytes(payload)
        return True

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        names = self._object_keys(keys)
        pages: list[bytes | None] = [None] * len(keys)

        def keep(i: int, payload: memoryview) -> bool:
            return self._keep_at(pages, i, 0, payload)

        # Sizes are unknown before the read: slots of the largest frame seen so
        # far, then one key at a time with the whole buffer for any that did not fit.
        hint = min(self._frame_hint, self.config.staging_bytes)
        status = self._read_staged(keys, names, [hint] * len(keys), keep)
        retry = [i for i, st in enumerate(status) if st < 0]
        for i in retry:
            self._read_staged(
                [keys[i]], [names[i]], [self.config.staging_bytes], partial(self._keep_at, pages, i)
            )
        with self._lock:
            for page in pages:
                if page is not None and len(page) + self._header > self._frame_hint:
                    self._frame_hint = len(page) + self._header
        self._reads.count([p is not None for p in pages])
        return pages

    def get_into(self, keys: Sequence[str], dests: Sequence[Sequence[memoryview]]) -> list[bool]:
        check_batch(keys, dests, "destinations")
        names = self._object_keys(keys)
        sizes = [chunks_nbytes(chunks) for chunks in dests]
        self._check_fits(keys, sizes)

        def scatter(i: int, payload: memoryview) -> bool:
            if payload.nbytes != sizes[i]:  # a page of another length: a miss, not corruption
                return False
            at = 0
            for chunk in dests[i]:
                flat = _flat(chunk)
                flat[:] = payload[at : at + flat.nbytes]
                at += flat.nbytes
            return True

        status = self._read_staged(keys, names, [self._header + s for s in sizes], scatter)
        ok = [st == 1 for st in status]
        self._reads.count(ok)
        return ok

    def set(self, keys: Sequence[str], values: Sequence[bytes | memoryview]) -> list[bool]:
        check_batch(keys, values, "values")
        return self._put(keys, [[_flat(v)] for v in values])

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        check_batch(keys, srcs, "sources")
        return self._put(keys, [[_flat(c) for c in chunks] for chunks in srcs])

    def _put(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        names = self._object_keys(keys)
        sizes = [chunks_nbytes(chunks) for chunks in srcs]
        self._check_fits(keys, sizes)
        ok = [False] * len(keys)
        if not keys:
            return ok
        # Existing keys (and repeats within the batch) succeed without being sent.
        with self._using() as store:
            present = store.batch_is_exist(names)
        todo: list[int] = []
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            if present[i] == 1:
                ok[i] = True
            elif name not in first:
                first[name] = i
                todo.append(i)
        stored = stored_bytes = 0
        with self._staging_lock:
            self._check_open()
            frames = [self._header + sizes[i] for i in todo]
            for part in self._rounds(frames):
                batch = [todo[j] for j in part]
                offsets, at = [], 0
                for i in batch:
                    offsets.append(at)
                    header = self._codec.header(keys[i], srcs[i])
                    self._staging_view[at : at + self._header] = header
                    at += self._header
                    for chunk in srcs[i]:
                        self._staging_view[at : at + chunk.nbytes] = chunk
                        at += chunk.nbytes
                results = self._store.batch_put_from(
                    [names[i] for i in batch],
                    [self._staging_addr + o for o in offsets],
                    [self._header + sizes[i] for i in batch],
                    self._replicate,
                )
                failed: list[tuple[str, int]] = []
                for i, rc in zip(batch, results, strict=True):
                    if rc == 0:
                        ok[i] = True
                        stored += 1
                        stored_bytes += sizes[i]
                    else:
                        failed.append((keys[i], rc))
                if failed:  # -200: no space left in the cluster's segments
                    log.warning(
                        "mooncake backend: %d of %d puts failed, first %r (code %s)",
                        len(failed),
                        len(batch),
                        *failed[0],
                    )
        for i, name in enumerate(names):
            if not ok[i] and first.get(name, i) != i:
                ok[i] = ok[first[name]]
        with self._lock:
            self._pages += stored
            self._bytes += stored_bytes
            if sizes:
                self._frame_hint = max(self._frame_hint, self._header + max(sizes))
        return ok

    def delete(self, keys: Sequence[str]) -> int:
        names = list(dict.fromkeys(self._object_keys(keys)))
        if not names:
            return 0
        # One batched RPC: a per-key size query first would cost one master
        # timeout per key when the master stalls. Sizes are not reported, so
        # the byte counter drops by the mean page, as in clear().
        with self._using() as store:
            results = store.batch_remove(names, True)
        removed = 0
        failed: list[int] = []
        for name, rc in zip(names, results, strict=True):
            if rc == 0:
                removed += 1
            elif rc != _OBJECT_NOT_FOUND:
                log.warning("mooncake backend: remove %r failed (code %s)", name, rc)
                failed.append(rc)
        self._forget(removed)
        if failed:  # not "nothing to delete": a clear must not read as done
            raise Unavailable(
                f"mooncake backend: {len(failed)} of {len(names)} removes failed (code {failed[0]}); "
                f"{removed} removed"
            )
        return removed

    def clear(self, prefix: str = "") -> int:
        if not isinstance(prefix, str):
            raise InvalidArgument(f"clear prefix must be a str, got {prefix!r}")
        self._check_open()
        pattern = "^" + _regex_literal(self.config.key_prefix + prefix)
        with self._using() as store:
            removed = int(store.remove_by_regex(pattern, True))
        if removed < 0:
            raise Unavailable(f"mooncake remove_by_regex({pattern!r}) failed (code {removed})")
        if prefix:
            self._forget(removed)
        else:
            with self._lock:
                self._pages = self._bytes = 0
        return removed

    def _forget(self, removed: int) -> None:
        """Count ``removed`` pages out; Mooncake does not report their sizes, so the
        byte counter drops by the mean page."""
        if not removed:
            return
        with self._lock:
            mean = self._bytes // self._pages if self._pages else 0
            self._pages = max(0, self._pages - removed)
            self._bytes = max(0, self._bytes - removed * mean)

    def stats(self) -> BackendStats:
        """Our own counters, once the master answered a probe (an existence query of a key
        nobody writes): Unavailable when it does not, so that GetStats shows the outage (the
        counters alone looked healthy while every put failed)."""
        with self._lock:
            self._check_open()
            pages, payload = self._pages, self._bytes
        with self._using() as store:
            probe = list(store.batch_is_exist([self.config.key_prefix + _PROBE_KEY]))
        if len(probe) != 1 or probe[0] < 0:
            raise Unavailable(
                f"mooncake master {self.config.master_addr} does not answer (codes {probe[:4]})"
            )
        reads = self._reads.snapshot()
        return BackendStats(
            pages=pages,
            bytes=payload,
            capacity_bytes=0,  # the cluster's segments, not ours: unknown to a client
            hits=reads.hits,
            misses=reads.misses,
            corrupt_pages=reads.corrupt_pages,
            evicted_pages=0,
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._idle.wait_for(lambda: not self._users)  # no new call starts once closed
        with self._staging_lock:  # a staged batch in flight finishes first
            rc = self._store.unregister_buffer(self._staging_addr)
            if rc != 0:
                log.warning("mooncake backend: unregister of the staging buffer failed (code %s)", rc)
            self._staging_view.release()
            self._staging = None
            self._store.close()
