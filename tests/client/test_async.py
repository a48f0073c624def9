"""The asyncio client has the blocking client's behaviour (same server, same assertions)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable

import grpc
import numpy as np
import pytest
from hicached_client import (
    AsyncHiCacheClient,
    AsyncSession,
    ClientClosedError,
    HiCacheClient,
    HiCacheError,
    RetryPolicy,
    Session,
    Transfer,
    WorkerIdentity,
)

from tests.client.scripted import GONE_SESSION, RETRY_AFTER_MS, SESSION, ScriptedServer

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02)


def _run(
    server: ScriptedServer, body: Callable[[AsyncHiCacheClient], Awaitable[None]], **kwargs: object
) -> None:
    async def main() -> None:
        kwargs.setdefault("retry", FAST_RETRY)
        async with AsyncHiCacheClient(server.target, timeout_s=10.0, **kwargs) as client:  # type: ignore[arg-type]
            await body(client)

    asyncio.run(main())


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }


@pytest.mark.parametrize(
    ("sync_cls", "async_cls"), [(Session, AsyncSession), (HiCacheClient, AsyncHiCacheClient)]
)
def test_async_api_mirrors_sync_api(sync_cls: type, async_cls: type) -> None:
    sync_api, async_api = _public(sync_cls), _public(async_cls)
    assert sorted(sync_api) == sorted(async_api)
    for name, sig in sync_api.items():
        assert list(sig.parameters) == list(async_api[name].parameters), name


def test_async_error_mapping(scripted_server: ScriptedServer) -> None:
    async def body(client: AsyncHiCacheClient) -> None:
        session = client.session(SESSION)
        with pytest.raises(HiCacheError) as info:
            await session.free("kv", np.array([2, 2]))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.message == "duplicate host page 2 in pool 'kv'"
        with pytest.raises(HiCacheError) as full:
            await session.alloc("full", 1)
        assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert full.value.retry_after_ms == RETRY_AFTER_MS

    _run(scripted_server, body)


def test_async_retries_reuse_op_id(scripted_server: ScriptedServer) -> None:
    scripted_server.servicer.script.fail_first["Alloc"] = 2
    scripted_server.servicer.script.fail_first["Load"] = 1

    async def body(client: AsyncHiCacheClient) -> None:
        session = client.session(SESSION)
        assert (await session.alloc("kv", 2)).host_pages == (0, 1)
        result = await session.load_wait([Transfer("kv", [1], host_pages=[2])])
        assert result.layers == (0, 1, 2)

    _run(scripted_server, body)
    for rpc, attempts in (("Alloc", 3), ("Load", 2)):
        ops = scripted_server.servicer.op_ids[rpc]
        assert len(ops) == attempts and len(set(ops)) == 1, rpc


def test_async_load_stream_and_mid_stream_failure(scripted_server: ScriptedServer) -> None:
    async def body(client: AsyncHiCacheClient) -> None:
        session = client.session(SESSION)
        layers = [p.layer async for p in session.load([Transfer("kv", [1], host_pages=[2])])]
        assert layers == [0, 1, 2, 2]
        scripted_server.servicer.script.load_fail_after = 2
        stream = session.retract_restore("b1", [Transfer("kv", [1])])
        with pytest.raises(HiCacheError) as info:
            async for _ in stream:
                pass
        assert info.value.code == grpc.StatusCode.DATA_LOSS

    _run(scripted_server, body)
    assert len(scripted_server.servicer.op_ids["Load"]) == 1
    assert [r.backup_id for r in scripted_server.servicer.requests["RetractRestore"]] == ["b1"]


def test_async_heartbeat_runs_and_stops(scripted_server: ScriptedServer) -> None:
    servicer = scripted_server.servicer

    async def body(client: AsyncHiCacheClient) -> None:
        started = time.monotonic()
        async with await client.attach(WorkerIdentity("w"), [], lease_ms=150) as session:
            assert session.heartbeat_running
            assert await asyncio.to_thread(servicer.heartbeat_event.wait, 5.0)
            assert time.monotonic() - started >= 0.15
        assert not session.heartbeat_running
        count = servicer.heartbeats
        lost = client.session(GONE_SESSION, lease_ms=30, heartbeat=True)
        deadline = time.monotonic() + 5.0
        while lost.heartbeat_running and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # polling with a deadline
        assert lost.lease_lost is not None and lost.lease_lost.code == grpc.StatusCode.NOT_FOUND
        assert servicer.heartbeats == count

    _run(scripted_server, body)
    assert len(servicer.op_ids["Detach"]) == 1


def test_async_token_and_admin(scripted_server: ScriptedServer) -> None:
    async def body(client: AsyncHiCacheClient) -> None:
        assert await client.ping(b"p") == b"p"
        assert (await client.drain(wait_flush=True)).flushed_pages == 7
        assert (await client.get_stats()).free_pages() == {"g1/kv": 60}

    _run(scripted_server, body, token="tok")
    assert {m.get("authorization") for m in scripted_server.servicer.metadata} == {"Bearer tok"}


def test_async_client_close_stops_session_heartbeats(scripted_server: ScriptedServer) -> None:
    async def main() -> None:
        client = AsyncHiCacheClient(scripted_server.target, retry=FAST_RETRY)
        session = await client.attach(WorkerIdentity("w"), [], lease_ms=60)
        deadline = time.monotonic() + 5.0
        while session.heartbeats < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # polling with a deadline
        assert session.heartbeats >= 1
        await client.close()
        assert not session.heartbeat_running

    asyncio.run(main())


def test_closing_either_client_under_a_call_fails_the_call_as_closed(scripted_server: ScriptedServer) -> None:
    """Fails before (a review of stop 47): closing the asyncio client while a call was under way
    raised ``asyncio.CancelledError`` in the awaiting task, which no ``except HiCacheError``
    catches (and the task read as cancelled though nobody cancelled it); the blocking client
    raised a bare CANCELLED ``Channel closed!``. Both now raise ClientClosedError (CANCELLED),
    for a unary call and a Load stream alike."""
    servicer = scripted_server.servicer
    ident = WorkerIdentity("w", 1, "m")

    def blocking(start: Callable[[Session], object]) -> BaseException | None:
        servicer.entered.clear()
        client = HiCacheClient(scripted_server.target, timeout_s=10.0, retry=FAST_RETRY)
        session = client.attach(ident, [], heartbeat=False)
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                start(session)
                outcome.append(None)
            except BaseException as exc:  # what the caller sees, whatever it is
                outcome.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        assert servicer.entered.wait(10)
        client.close()
        caller.join(10)
        return outcome[0]

    async def asynchronous(
        start: Callable[[AsyncSession], Awaitable[object]],
    ) -> tuple[BaseException | None, bool]:
        servicer.entered.clear()
        client = AsyncHiCacheClient(scripted_server.target, timeout_s=10.0, retry=FAST_RETRY)
        session = await client.attach(ident, [], heartbeat=False)
        task = asyncio.create_task(start(session))
        assert await asyncio.to_thread(servicer.entered.wait, 10)
        await client.close()
        done, _ = await asyncio.wait([task], timeout=10)
        assert done, "the call ended"
        return (None if task.cancelled() else task.exception()), task.cancelled()

    held = [Transfer("hold", [1])]
    try:
        for start in (lambda s: s.alloc("hold", 1), lambda s: s.load(held).wait()):
            error = blocking(start)
            assert isinstance(error, ClientClosedError) and error.code == grpc.StatusCode.CANCELLED, error
        for astart in (lambda s: s.alloc("hold", 1), lambda s: s.load(held).wait()):
            error, cancelled = asyncio.run(asynchronous(astart))
            assert not cancelled and isinstance(error, ClientClosedError), error
    finally:
        servicer.released.set()
