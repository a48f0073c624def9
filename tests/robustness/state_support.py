"""Shared by the tests/robustness/test_state_*.py modules: one worker's device pools (real
shared memory) with an anchor ``kv``, a sidecar ``swa`` and a ``draft`` pool derived from
``kv``; the daemon-visible state a failed call must leave unchanged."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from hicached_client import HiCacheClient, RetryPolicy, pool_spec
from hicached_client.export import ShmKVPool
from hicached_client.v1 import types_pb2 as tpb

from tests.support import state as support

PAGE, LAYERS, HEADS, DIM = 4, 2, 2, 8
DEVICE_PAGES = 64
POOLS = ("kv", "swa", "draft")


@contextmanager
def device_pools() -> Iterator[dict[str, ShmKVPool]]:
    tag = uuid.uuid4().hex[:8]
    made: dict[str, ShmKVPool] = {}
    try:
        for name in POOLS:
            made[name] = ShmKVPool(
                f"hcrs-{tag}-{name}",
                num_layers=LAYERS,
                tokens=DEVICE_PAGES * PAGE,
                heads=HEADS,
                head_dim=DIM,
                dtype=torch.float16,
            )
        yield made
    finally:
        for pool in made.values():
            pool.close()
            pool.unlink()


def specs(
    device: dict[str, ShmKVPool], *, ratio: float = 0.25, names: Sequence[str] = POOLS, **kv: Any
) -> list[tpb.PoolSpec]:
    roles = {"kv": ("anchor", ""), "swa": ("sidecar", ""), "draft": ("derived", "kv")}
    out = []
    for name in names:
        role, source = roles[name]
        args: dict[str, Any] = dict(
            role=role,
            kind="mha",
            dtype="float16",
            host_layout="page_first",
            page_size=PAGE,
            num_layers=LAYERS,
            num_heads=HEADS,
            head_dim=DIM,
            k_buffers=device[name].k_buffers(),
            v_buffers=device[name].v_buffers(),
            host_ratio=ratio,
            indices_from_pool=source,
        )
        if name == "kv":
            args.update(kv)
        out.append(pool_spec(name, **args))
    return out


def no_retry_client(target: str) -> HiCacheClient:
    """A client that reports the first answer (the op-id tests drive the retries themselves)."""
    return HiCacheClient(target, timeout_s=30.0, retry=RetryPolicy(max_attempts=1))


def state(client: HiCacheClient) -> dict[str, Any]:
    """The daemon's state as its admin sees it (:func:`tests.support.state.state`)."""
    return support.state(client)
