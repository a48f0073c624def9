"""The daemon's servicers, composed from one module per concept.

* :class:`CacheServicer` (hicached.v1.HiCacheService): sessions and observability
  (:mod:`~hicached.server.rpc_sessions`), host pages, data plane and retraction
  (:mod:`~hicached.server.rpc_pages`), content-addressed RPCs
  (:mod:`~hicached.server.rpc_keyed`);
* :class:`AdminServicer` (hicached.v1.AdminService, :mod:`~hicached.server.rpc_admin`).

Each method converts messages and offloads one core call where
:data:`hicached.server.lanes.RPC_LANES` places it; what every call goes through
(authentication, session capability, error -> status, metrics) is in
:mod:`hicached.server.interceptors`. One instance per listener, bound to its role.
"""

from __future__ import annotations

from typing import Any

from hicached_client.v1 import hicached_pb2_grpc as pb_grpc

from hicached.core.keyed import KeyedCache
from hicached.core.service import HiCacheCore
from hicached.server.lanes import Lanes
from hicached.server.rpc_admin import AdminServicer
from hicached.server.rpc_base import ServicerOptions
from hicached.server.rpc_keyed import KeyedRpcs
from hicached.server.rpc_pages import PageRpcs
from hicached.server.rpc_sessions import SessionRpcs

__all__ = ["AdminServicer", "CacheServicer", "ServicerOptions"]


class CacheServicer(KeyedRpcs, PageRpcs, SessionRpcs, pb_grpc.HiCacheServiceServicer):
    """The full hicached.v1.HiCacheService."""

    def __init__(self, core: HiCacheCore, lanes: Lanes, *, keyed: KeyedCache, **kw: Any) -> None:
        super().__init__(core, lanes, **kw)
        self.keyed = keyed
