"""The core in-process: HiCacheCore and KeyedCache over real shared-memory pools, no gRPC.

A worker's "device" pools are real ``ShmKVPool`` segments (as in
tests/integration); its attach goes through the same conversion the servicer
uses, so the core sees exactly what a daemon would.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hicached_client import pool_spec
from hicached_client.export import ShmKVPool
from hicached_client.v1 import types_pb2 as tpb

from hicached.config import Config
from hicached.core.groups import GroupRegistry
from hicached.core.keyed import KeyedCache
from hicached.core.keyed_types import KeyedOptions
from hicached.core.service import HiCacheCore
from hicached.core.types import PoolRequest, WorkerId
from hicached.daemon import attach_content_index
from hicached.l3 import StorageBackend
from hicached.server import convert
from hicached.transfer.engine import CopyEngine

PAGE_SIZE = 4
DEVICE_PAGES = 64
LAYERS, HEADS, DIM = 2, 2, 8


@dataclass
class Core:
    core: HiCacheCore
    keyed: KeyedCache
    device: dict[str, ShmKVPool]
    dups: list[int] = dataclasses.field(default_factory=list)

    def specs(self, *, ratio: float = 0.25, derived: bool = True, **kv: Any) -> list[PoolRequest]:
        """kv (anchor), swa (sidecar) and, with ``derived``, draft (derived from kv)."""

        def spec(name: str, role: str, **extra: Any) -> tpb.PoolSpec:
            pool = self.device[name]
            args: dict[str, Any] = dict(
                role=role,
                kind="mha",
                dtype="float16",
                host_layout="page_first",
                page_size=PAGE_SIZE,
                num_layers=LAYERS,
                num_heads=HEADS,
                head_dim=DIM,
                k_buffers=pool.k_buffers(),
                v_buffers=pool.v_buffers(),
                host_ratio=ratio,
            )
            args.update(extra)
            return pool_spec(name, **args)

        specs = [spec("kv", "anchor", **kv), spec("swa", "sidecar")]
        if derived:
            specs.append(spec("draft", "derived", indices_from_pool="kv"))
        # In-process handoff: each handle's fd_index is the local fd (see export_fd_tensor);
        # the core gets a duplicate at that index, as a daemon gets the handed-over fds.
        local = {b.handle.fd.fd_index for s in specs for b in (*s.k_buffers, *s.v_buffers)}
        fds = [-1] * (max(local) + 1)
        for fd in local:
            fds[fd] = os.dup(fd)
            self.dups.append(fds[fd])
        return [convert.pool_request(s, i, fds) for i, s in enumerate(specs)]

    def attach(self, instance: str = "w", **kw: Any) -> str:
        worker = WorkerId(instance_id=instance, generation=1, model_name=kw.pop("model", "m"))
        worker = dataclasses.replace(worker, **{k: kw.pop(k) for k in list(kw) if hasattr(worker, k)})
        return self.core.attach(worker, self.specs(**kw)).session_id

    def put(self, session_id: str, keys: Sequence[str]) -> None:
        """``keys`` published through PutBytes, every allocating pool, page ``i`` filled with
        byte ``i % 251``; all of them new."""
        _, state = self.core.session_group(session_id)
        body = [
            (key, pool, bytes([i % 251]) * state.pool(pool).page_bytes)
            for i, key in enumerate(keys)
            for pool in state.owning_pools()
        ]
        assert self.keyed.put_bytes(session_id, "", body) == (len(keys), 0)

    def pools(self, session_id: str) -> dict[str, tuple[int, int]]:
        """(free, total) pages of every host pool of the session's group."""
        _, state = self.core.session_group(session_id)
        return {
            e.name: (e.host_pool.allocator.available(), e.host_pool.num_pages) for e in state.group.entries
        }

    def indexed(self, session_id: str) -> int:
        _, state = self.core.session_group(session_id)
        assert state.index is not None
        return state.index.stats().entries

    def owned(self, session_id: str) -> int:
        session, _ = self.core.session_group(session_id)
        return session.ledger.count()


@pytest.fixture
def make_core() -> Iterator[Callable[..., Core]]:
    made: list[tuple[Core, CopyEngine]] = []

    def make(*, l3: StorageBackend | None = None, **sessions: Any) -> Core:
        """A core with ``sessions`` config overrides; ``l3``: its L3 backend (none by default)."""
        tag = uuid.uuid4().hex[:10]
        cfg = Config()
        cfg = dataclasses.replace(
            cfg,
            host=dataclasses.replace(cfg.host, budget=1 << 30, shm_prefix=f"hct-core-{tag}", prefault=False),
            sessions=dataclasses.replace(cfg.sessions, **sessions),
        )
        device = {
            name: ShmKVPool(
                f"hct-core-{tag}-dev-{name}",
                num_layers=LAYERS,
                tokens=PAGE_SIZE * DEVICE_PAGES,
                heads=HEADS,
                head_dim=DIM,
                dtype=torch.float16,
            )
            for name in ("kv", "swa", "draft")
        }
        engine = CopyEngine(workers=1, max_queued_bytes=cfg.copy.max_queued)
        core = HiCacheCore(
            cfg,
            groups=GroupRegistry(cfg.host, daemon_id=tag, max_key_bytes=cfg.limits.max_key_bytes),
            engine=engine,
            attach_index=lambda state: attach_content_index(cfg, state, backend=l3, metrics=None),
        )
        keyed = KeyedCache(core=core, options=KeyedOptions.from_config(cfg))
        c = Core(core, keyed, device)
        made.append((c, engine))
        return c

    yield make
    for c, engine in made:
        c.core.close()
        engine.close()
        for pool in c.device.values():
            pool.close()
            pool.unlink()
        for fd in c.dups:
            os.close(fd)  # the caller closes the handed-over fds, as the servicer does


def pages(values: Any) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int64)
