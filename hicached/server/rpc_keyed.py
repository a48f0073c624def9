"""Content-addressed RPCs of HiCacheService: Lookup, Publish, Put/GetPages, Prefetch, Backup,
Put/GetBytes (see :mod:`hicached.core.keyed`).

A request's KeySource is turned into page keys first: counts are checked on the event
loop (O(1)); hashing, and copying and checking more than :data:`INLINE_KEYS` given keys,
run on the hash lane. The tenant is always the session's own.

Thread-safety: as :mod:`hicached.server.rpc_base` (methods on the event loop).
"""

from __future__ import annotations

from typing import Any

from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

from hicached.core.keyed import KeyedCache
from hicached.errors import InvalidArgument
from hicached.index.types import PrefetchPolicy, PrefetchState
from hicached.page_keys import page_keys
from hicached.server import convert
from hicached.server.limits import (
    check_count,
    check_id_values,
    check_keys,
    check_page_readable,
    check_pool_names,
    check_response,
)
from hicached.server.rpc_base import Ctx, ServicerBase, no_fence, same_tenant

# Up to this many given keys are copied and checked on the event loop: ~40-70 us for 256
# keys (each at most limits.max_key_bytes), where the hop to the hash lane and back costs
# ~200 us -- SGLang's batches are 128 keys, so each of its calls saved one hop.
INLINE_KEYS = 256
# What a Lookup answer counts against its peer's unread answers, per byte on the wire (the
# message, its serialization and gRPC's copy live until it is sent; ~2.5 measured).
LOOKUP_HELD_PER_WIRE_BYTE = 3


class KeyedRpcs(ServicerBase):
    """The content-addressed RPCs of HiCacheService (see hicached.core.keyed)."""

    keyed: KeyedCache

    async def keys_of(self, session_id: str, source: tpb.KeySource) -> tuple[list[str], str]:
        """(keys, tenant) of a KeySource; token chains are hashed with the group's page size.

        The tenant is the session's; a KeySource.tenant naming another is PERMISSION_DENIED.
        Counts are checked here (O(1)); hashing, and the copy and per-key length checks of
        more than INLINE_KEYS given keys, run on the hash lane, never on the event loop.
        """
        kind = source.WhichOneof("source")
        tenant = self.keyed.tenant(session_id)
        lim = self.limits
        check_id_values((("keys.tenant", source.tenant),), lim)  # as a top-level tenant is
        same_tenant(tenant, source.tenant, "keys.tenant")
        if kind == "keys":
            check_count("keys in this request", len(source.keys.keys), lim.max_keys_per_request,
                        "limits.max_keys_per_request")  # fmt: skip
            if len(source.keys.keys) <= INLINE_KEYS:
                return self._given_keys(source.keys), tenant
            return await self.lanes.hash.run(self._given_keys, source.keys, session=session_id), tenant
        if kind == "tokens":
            chain = source.tokens
            check_count("token ids in keys.tokens", len(chain.token_ids), lim.max_tokens_per_request,
                        "limits.max_tokens_per_request")  # fmt: skip
            page = self.keyed.page_size(session_id)
            n = len(chain.token_ids)
            pages = -(-n // page) if chain.include_partial_page else n // page  # a partial page has a key
            check_count(
                "keys in this request", pages, lim.max_keys_per_request, "limits.max_keys_per_request"
            )
            return await self.lanes.hash.run(self._token_keys, chain, page, session=session_id), tenant
        raise InvalidArgument("keys is empty: set keys.keys or keys.tokens")

    def _given_keys(self, keys: tpb.PageKeys) -> list[str]:
        out = list(keys.keys)
        check_keys(out, self.limits)
        return out

    def _given_pages(self, given: Any) -> list[tuple[str, str, bytes]]:
        pages = [(p.key, p.pool, p.data) for p in given]
        check_keys([key for key, _, _ in pages], self.limits)
        check_pool_names("pages", (pool for _, pool, _ in pages), self.limits)
        return pages

    def _token_keys(self, chain: tpb.TokenChain, page_size: int) -> list[str]:
        # The repeated field itself, not list(...) of it: page_keys slices one page at a time,
        # so no single C call holds the GIL for the whole chain (4 M ids: ~0.2 s of event-loop stall).
        return page_keys(
            chain.token_ids,  # type: ignore[arg-type]
            page_size,
            extra_key=chain.extra_key if chain.HasField("extra_key") else None,
            cache_salt=chain.cache_salt if chain.HasField("cache_salt") else None,
            include_partial=chain.include_partial_page,
        )

    async def Lookup(self, request: pb.LookupRequest, context: Ctx) -> pb.LookupResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        # Derived keys go back; given ones do not (the client has them): echoing up to
        # max_keys_per_request x max_key_bytes (32 MiB) was built and serialized on the event
        # loop, and held while a client that stopped reading let it sit unsent.
        derived = keys if request.keys.WhichOneof("source") == "tokens" else []
        wire = sum(map(len, derived)) + 3 * len(derived) + (2 * len(keys) if request.per_key else 0)
        if wire:
            # Counted until the client reads it, as a GetBytes answer is: a 64 KiB chain of
            # one-token pages derives ~4.4 MiB of keys, and the daemon held ~2.5 times an
            # answer's wire size until it was sent (measured), whoever asked.
            what = f"Lookup of {len(keys)} keys"
            self.hold_answer(context, request.session_id, LOOKUP_HELD_PER_WIRE_BYTE * wire, what)
        result = await self.offload(
            "Lookup",
            self.keyed.lookup,
            request.session_id,
            keys,
            l3=self.has_l3(),
            session=request.session_id,
            per_key=request.per_key,
        )
        return pb.LookupResponse(
            keys=derived,
            l2_hit_pages=result.l2_hit_pages,
            total_hit_pages=result.total_hit_pages,
            in_l2=result.in_l2,
            cached=result.cached,
        )

    async def Publish(self, request: pb.PublishRequest, context: Ctx) -> pb.PublishResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        transfers = self.transfers_in(request.transfers)
        published, existing = await self.offload(
            "Publish",
            self.keyed.publish,
            request.session_id,
            request.op_id,
            keys,
            transfers,
            session=request.session_id,
        )
        return pb.PublishResponse(published_pages=published, existing_pages=existing)

    async def PutPages(self, request: pb.PutPagesRequest, context: Ctx) -> pb.PutPagesResponse:
        no_fence(request.ready)
        keys, _ = await self.keys_of(request.session_id, request.keys)
        transfers = self.batch_in(request.batch, request.session_id)
        r = await self.offload(
            "PutPages",
            self.keyed.put_pages,
            request.session_id,
            request.op_id,
            keys,
            transfers,
            session=request.session_id,
        )
        return pb.PutPagesResponse(
            ok=r.ok,
            stored_pages=r.stored_pages,
            existing_pages=r.existing_pages,
            acks=convert.acks_out(r.acks),
            reason=r.reason,
        )

    async def GetPages(self, request: pb.GetPagesRequest, context: Ctx) -> pb.GetPagesResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        transfers = self.batch_in(request.batch, request.session_id)
        hit, acks = await self.offload(
            "GetPages",
            self.keyed.get_pages,
            request.session_id,
            request.op_id,
            keys,
            transfers,
            include_l3=request.include_l3,
            waiting=self.waiting(context) if request.include_l3 else None,  # asked after an L3 read only
            l3=request.include_l3,
            session=request.session_id,
        )
        return pb.GetPagesResponse(hit_pages=hit, acks=convert.acks_out(acks))

    async def Prefetch(self, request: pb.PrefetchRequest, context: Ctx) -> pb.PrefetchResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        if request.policy not in PREFETCH_POLICIES:
            raise InvalidArgument(f"policy = {request.policy} is not a PrefetchPolicy")
        pid, planned = await self.offload(
            "Prefetch",
            self.keyed.prefetch,
            request.session_id,
            keys,
            policy=PREFETCH_POLICIES[request.policy],
            timeout_ms=request.timeout_ms,
            op_id=request.op_id,
            session=request.session_id,
        )
        return pb.PrefetchResponse(prefetch_id=pid, planned_pages=planned)

    async def PrefetchStatus(
        self, request: pb.PrefetchStatusRequest, context: Ctx
    ) -> pb.PrefetchStatusResponse:
        status = await self.offload(
            "PrefetchStatus",
            self.keyed.prefetch_status,
            request.session_id,
            request.prefetch_id,
            wait=request.wait,
            timeout_s=self.limits.max_wait_s,
            session=request.session_id,
        )
        return pb.PrefetchStatusResponse(
            state=PREFETCH_STATES[status.state],
            completed_pages=status.completed_pages,
            planned_pages=status.planned_pages,
        )

    async def CancelPrefetch(
        self, request: pb.CancelPrefetchRequest, context: Ctx
    ) -> pb.CancelPrefetchResponse:
        done = await self.offload(
            "CancelPrefetch",
            self.keyed.cancel_prefetch,
            request.session_id,
            request.prefetch_id,
            timeout_s=self.limits.max_wait_s,
            session=request.session_id,
        )
        return pb.CancelPrefetchResponse(completed_pages=done)

    async def Backup(self, request: pb.BackupRequest, context: Ctx) -> pb.BackupResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        r = await self.offload(
            "Backup",
            self.keyed.backup,
            request.session_id,
            keys,
            wait=request.wait,
            timeout_s=self.limits.max_wait_s,
            session=request.session_id,
        )
        return pb.BackupResponse(queued_pages=r.queued, stored_pages=r.stored, shortfall=r.shortfall)

    async def PutBytes(self, request: pb.PutBytesRequest, context: Ctx) -> pb.PutBytesResponse:
        same_tenant(self.keyed.tenant(request.session_id), request.tenant, "tenant")
        check_count("pages in this request", len(request.pages), self.limits.max_keys_per_request,
                    "limits.max_keys_per_request")  # fmt: skip
        # A page no GetBytes could answer would be stored, found by Lookup, and never read back.
        check_page_readable(
            self.keyed.page_bytes(request.session_id), self.limits, self.options.max_message_bytes
        )
        pages = await self.lanes.hash.run(self._given_pages, request.pages, session=request.session_id)
        stored, existing = await self.offload(
            "PutBytes",
            self.keyed.put_bytes,
            request.session_id,
            request.op_id,
            pages,
            session=request.session_id,
        )
        return pb.PutBytesResponse(stored_pages=stored, existing_pages=existing)

    async def GetBytes(self, request: pb.GetBytesRequest, context: Ctx) -> pb.GetBytesResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        # The answer's size, before building it: every key may hit, each with its pages of every pool.
        what = f"GetBytes of {len(keys)} keys"
        nbytes = len(keys) * self.keyed.page_bytes(request.session_id)
        check_response(what, nbytes, self.limits, self.options.max_message_bytes)
        self.hold_answer(context, request.session_id, nbytes, what)
        hit, pages = await self.offload(
            "GetBytes",
            self.keyed.get_bytes,
            request.session_id,
            keys,
            include_l3=request.include_l3,
            l3=request.include_l3,
            session=request.session_id,
        )
        return pb.GetBytesResponse(
            pages=[tpb.PageBytes(key=k, pool=p, data=d) for k, p, d in pages], hit_pages=hit
        )


# The wire's policy -> the index's (UNSPECIFIED: the configured l3.prefetch_policy).
PREFETCH_POLICIES: dict[int, PrefetchPolicy | None] = {
    pb.PREFETCH_POLICY_UNSPECIFIED: None,
    pb.PREFETCH_POLICY_BEST_EFFORT: PrefetchPolicy.BEST_EFFORT,
    pb.PREFETCH_POLICY_WAIT_COMPLETE: PrefetchPolicy.WAIT_COMPLETE,
    pb.PREFETCH_POLICY_TIMEOUT: PrefetchPolicy.TIMEOUT,
}
PREFETCH_STATES = {
    PrefetchState.RUNNING: pb.PREFETCH_STATE_RUNNING,
    PrefetchState.DONE: pb.PREFETCH_STATE_DONE,
    PrefetchState.CANCELLED: pb.PREFETCH_STATE_CANCELLED,
    PrefetchState.TIMED_OUT: pb.PREFETCH_STATE_TIMED_OUT,
    PrefetchState.FAILED: pb.PREFETCH_STATE_FAILED,
}
