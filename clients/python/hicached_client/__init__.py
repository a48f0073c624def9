"""Client library for the hicached daemon (wire contract ``hicached.v1``).

``HiCacheClient`` (blocking) and ``AsyncHiCacheClient`` (asyncio) expose every
RPC with typed arguments and frozen-dataclass results; ``client.attach(...)``
returns a session object whose methods carry the session id and a fresh op_id.
Every failed call raises :class:`HiCacheError` (status code, the daemon's
message, ``retry_after_ms``).
"""

from hicached_client._calls import new_op_id
from hicached_client._channel import NO_RETRY, ChannelConfig, RetryPolicy, default_target
from hicached_client.aio import AsyncHiCacheClient, AsyncLoadStream, AsyncSession
from hicached_client.errors import ClientClosedError, HiCacheError
from hicached_client.specs import pool_spec
from hicached_client.sync import HiCacheClient, LoadStream, Session
from hicached_client.types import (
    AllocResult,
    AttachResult,
    BackendInfo,
    BackupResult,
    ClearNamespaceResult,
    DataType,
    DrainResult,
    GetBytesResult,
    GetPagesResult,
    GroupInfo,
    HostLayout,
    Keys,
    LoadProgress,
    LoadResult,
    LookupResult,
    PageBytes,
    PageIndices,
    PoolAck,
    PoolInfo,
    PoolKind,
    PoolRole,
    PrefetchPolicy,
    PrefetchState,
    PrefetchStatus,
    PrefetchTicket,
    PublishResult,
    PutBytesResult,
    PutPagesResult,
    ResolveResult,
    RetractBackupResult,
    RetractionInfo,
    SessionInfo,
    SessionPool,
    Stats,
    TokenChain,
    Transfer,
    WorkerIdentity,
    WriteResult,
)

__version__ = "0.1.0"

__all__ = [
    "NO_RETRY",
    "AllocResult",
    "AsyncHiCacheClient",
    "AsyncLoadStream",
    "AsyncSession",
    "AttachResult",
    "BackendInfo",
    "BackupResult",
    "ChannelConfig",
    "ClearNamespaceResult",
    "ClientClosedError",
    "DataType",
    "DrainResult",
    "GetBytesResult",
    "GetPagesResult",
    "GroupInfo",
    "HiCacheClient",
    "HiCacheError",
    "HostLayout",
    "Keys",
    "LoadProgress",
    "LoadResult",
    "LoadStream",
    "LookupResult",
    "PageBytes",
    "PageIndices",
    "PoolAck",
    "PoolInfo",
    "PoolKind",
    "PoolRole",
    "PrefetchPolicy",
    "PrefetchState",
    "PrefetchStatus",
    "PrefetchTicket",
    "PublishResult",
    "PutBytesResult",
    "PutPagesResult",
    "ResolveResult",
    "RetractBackupResult",
    "RetractionInfo",
    "RetryPolicy",
    "Session",
    "SessionInfo",
    "SessionPool",
    "Stats",
    "TokenChain",
    "Transfer",
    "WorkerIdentity",
    "WriteResult",
    "default_target",
    "new_op_id",
    "pool_spec",
]
