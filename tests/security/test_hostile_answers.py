"""The worker is the victim: what a hostile or broken daemon answers cannot forge the worker's
log lines, crash its adapters or make it busy-loop.

Each test runs a fake hicached (:class:`Fake`: a real gRPC server with the generated stubs on a
Unix socket in this process, with the fd handoff answered) whose answers the test sets, and the
real client library against it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from hicached_client import (
    AsyncHiCacheClient,
    HiCacheClient,
    HiCacheError,
    TokenChain,
    Transfer,
    WorkerIdentity,
)
from hicached_client.errors import MIN_BEAT_S
from hicached_client.hf import HFKVCache, KVShape
from hicached_client.sglang.config import AdapterConfig
from hicached_client.sglang.refusals import RefusalLog
from hicached_client.sglang.transports import BytesTransport
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc
from hicached_client.v1 import types_pb2 as tpb

from tests.security.roles_helpers import scratch_dir

# A forged second line, a screen clear, a window title, a bidi override.
EVIL = "no room\nWARNING hicached: all clear\x1b[2J\x1b]0;owned\x07\u202eend"
RAW = ("\n", "\r", "\x1b", "\x07", "\u202e")
# The byte transport's page: GROUPS chunks.
GROUPS, PAGE = 4, 4 * 256


@dataclass
class Answers:
    lease_ms: int = 30_000
    put_pages: pb.PutPagesResponse = field(default_factory=lambda: pb.PutPagesResponse(ok=True))
    get_pages: pb.GetPagesResponse = field(default_factory=pb.GetPagesResponse)
    lookup: pb.LookupResponse | Callable[[pb.LookupRequest], pb.LookupResponse] = field(
        default_factory=pb.LookupResponse
    )
    get_bytes: Callable[[pb.GetBytesRequest], pb.GetBytesResponse] = lambda _: pb.GetBytesResponse()
    fail: tuple[grpc.StatusCode, str] | None = None
    heartbeats: list[float] = field(default_factory=list)
    five_beats: threading.Event = field(default_factory=threading.Event)


class _Service(pb_grpc.HiCacheServiceServicer):
    def __init__(self, answers: Answers) -> None:
        self.a = answers

    def _check(self, context: Any) -> None:
        if self.a.fail is not None:
            context.abort(*self.a.fail)

    def Attach(self, request: Any, context: Any) -> pb.AttachResponse:
        return pb.AttachResponse(session_id="s-1", session_secret="0123abcd", lease_ms=self.a.lease_ms)

    def Heartbeat(self, request: Any, context: Any) -> pb.HeartbeatResponse:
        self.a.heartbeats.append(time.monotonic())
        if len(self.a.heartbeats) >= 5:
            self.a.five_beats.set()
        return pb.HeartbeatResponse()

    def Detach(self, request: Any, context: Any) -> pb.DetachResponse:
        return pb.DetachResponse()

    def PutPages(self, request: Any, context: Any) -> pb.PutPagesResponse:
        self._check(context)
        return self.a.put_pages

    def GetPages(self, request: Any, context: Any) -> pb.GetPagesResponse:
        self._check(context)
        return self.a.get_pages

    def Lookup(self, request: Any, context: Any) -> pb.LookupResponse:
        self._check(context)
        answer = self.a.lookup
        return answer(request) if callable(answer) else answer

    def GetBytes(self, request: Any, context: Any) -> pb.GetBytesResponse:
        self._check(context)
        return self.a.get_bytes(request)


def _handoff(path: Path) -> socket.socket:
    """Answers every fd handoff with a ticket (this process's uid: a trusted listener)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)

    def run() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                _, fds, _, _ = socket.recv_fds(conn, 64, 64)
                for fd in fds:
                    os.close(fd)
                conn.sendall(b"ok ticket\n")

    threading.Thread(target=run, daemon=True).start()
    return srv


@dataclass
class Fake:
    target: str
    answers: Answers


@pytest.fixture
def fake() -> Iterator[Fake]:
    base = scratch_dir()
    sock = base / "hicached.sock"
    answers = Answers()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_HiCacheServiceServicer_to_server(_Service(answers), server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    handoff = _handoff(Path(f"{sock}.fds"))
    try:
        yield Fake(f"unix://{sock}", answers)
    finally:
        handoff.close()
        server.stop(None)
        shutil.rmtree(base, ignore_errors=True)


def test_the_daemons_text_reaches_the_log_as_one_line(fake: Fake, caplog: pytest.LogCaptureFixture) -> None:
    """A refusal's reason (the SGLang adapter's rate-limited line) and an error's details were
    logged raw: a newline forged a second log line, escapes drove the operator's terminal."""
    fake.answers.put_pages = pb.PutPagesResponse(ok=False, reason=EVIL)
    log = logging.getLogger("victim")
    with HiCacheClient(fake.target) as client:
        session = client.attach(WorkerIdentity("w"), [], heartbeat=False)
        refused = session.put_pages(["k"], [Transfer("kv", [0])])
        assert refused.reason == EVIL  # the result keeps the daemon's words as sent
        with caplog.at_level(logging.WARNING, logger="victim"):
            RefusalLog(log).refused("kv", 1, refused.reason)
            fake.answers.fail = (grpc.StatusCode.INTERNAL, EVIL)
            with pytest.raises(HiCacheError) as info:
                session.lookup(["k"])
            log.warning("hicached: lookup failed, reading as a miss: %s", info.value)
    assert info.value.message == EVIL
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("all clear" in line for line in lines), lines
    for line in lines:
        assert not any(ch in line for ch in RAW), repr(line)


def test_the_hf_adapter_restores_no_more_than_it_loaded(fake: Fake) -> None:
    """A hit count above the pages asked for made ``load_prefix`` of 9 tokens return
    ``tokens=4000000`` and a cache of the whole staging area (pages nothing was loaded into,
    left from earlier requests), and ``cached_tokens`` report 2**42 tokens."""
    fake.answers.get_pages = pb.GetPagesResponse(hit_pages=10**6)
    fake.answers.lookup = pb.LookupResponse(l2_hit_pages=2**40, total_hit_pages=2**40)
    with HiCacheClient(fake.target) as client:
        hf = HFKVCache(client, model_name="m", shape=KVShape(2, 2, 8, torch.float32), page_size=4, slots=64)
        try:
            ids = list(range(9))  # two whole pages, and one token left to compute
            cache, tokens = hf.load_prefix(ids)
            assert tokens == 8 and cache.get_seq_length() == 8
            with pytest.raises(HiCacheError) as info:
                hf.cached_tokens(ids)
            assert info.value.code == grpc.StatusCode.INTERNAL
        finally:
            hf.close()


@pytest.mark.parametrize(
    "page",
    [
        lambda key: tpb.PageBytes(key=key, pool="kv", data=b"x" * 3),  # short
        lambda key: tpb.PageBytes(key=key, pool="kv", data=b"x" * (PAGE + 1)),  # long
        lambda key: tpb.PageBytes(key=f"other-{key}", pool="kv", data=b"x" * PAGE),  # another key
    ],
    ids=["short", "long", "other-key"],
)
def test_the_sglang_byte_transport_takes_only_whole_pages_of_its_keys(
    fake: Fake, page: Callable[[str], tpb.PageBytes]
) -> None:
    """GetBytes pages of the wrong size raised RuntimeError (a tensor view) from
    ``batch_get_v1`` into SGLang's thread (it is not one of the failures read as a miss)."""
    fake.answers.get_bytes = lambda req: pb.GetBytesResponse(
        hit_pages=len(req.keys.keys.keys), pages=[page(k) for k in req.keys.keys.keys]
    )
    geometry = SimpleNamespace(groups=GROUPS, chunk_bytes=PAGE // GROUPS)
    drained: list[torch.Tensor] = []
    with HiCacheClient(fake.target) as client:
        session = client.attach(WorkerIdentity("w"), [], heartbeat=False)
        transport = BytesTransport(
            session, SimpleNamespace(geometry=geometry), AdapterConfig(target=fake.target)
        )  # type: ignore[arg-type]
        assert transport.get(["k0", "k1"], drained.append) == 0
    assert drained == []


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "asyncio"])
def test_a_tiny_lease_does_not_make_the_worker_spin(fake: Fake, aio: bool) -> None:
    """``lease_ms=1`` in the Attach answer made the heartbeat beat every 0.33 ms: 2,039 beats
    in 2 s and 1.26 s of the worker's CPU. Beats are now at least MIN_BEAT_S apart."""
    fake.answers.lease_ms = 1
    if aio:
        asyncio.run(_attach_and_beat_async(fake))
    else:
        with HiCacheClient(fake.target) as client:
            session = client.attach(WorkerIdentity("w"), [])
            assert fake.answers.five_beats.wait(30), "five heartbeats"
            session.stop_heartbeat()
    beats = fake.answers.heartbeats[:5]
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert min(gaps) >= MIN_BEAT_S * 0.9, gaps


async def _attach_and_beat_async(fake: Fake) -> None:
    async with AsyncHiCacheClient(fake.target) as client:
        session = await client.attach(WorkerIdentity("w"), [])
        assert await asyncio.to_thread(fake.answers.five_beats.wait, 30), "five heartbeats"
        await session.stop_heartbeat()


@pytest.mark.parametrize(
    "answer",
    [
        pb.LookupResponse(in_l2=[True], cached=[True]),  # short: the missing flags read as hits
        pb.LookupResponse(in_l2=[True] * 6, cached=[True] * 6),  # long
        pb.LookupResponse(in_l2=[True] * 4, cached=[True] * 3),  # the two lists disagree
    ],
    ids=["short", "long", "uneven"],
)
def test_per_key_flags_that_do_not_match_the_keys_are_an_error(fake: Fake, answer: pb.LookupResponse) -> None:
    """A per-key Lookup answered with one flag for four keys was taken as sent: the SGLang
    adapter's ``batch_exists_v2`` (TRAILING_PAGES) reads every page past the list as a hit
    (``all([])``), so a hostile daemon made SGLang restore pages nothing held. Each is now
    INTERNAL, which the adapter reads as a miss."""
    fake.answers.lookup = answer
    with HiCacheClient(fake.target) as client:
        session = client.attach(WorkerIdentity("w"), [], heartbeat=False)
        with pytest.raises(HiCacheError) as info:
            session.lookup(["k0", "k1", "k2", "k3"], per_key=True)
    assert info.value.code == grpc.StatusCode.INTERNAL, info.value
    assert info.value.method == "Lookup" and "flags for 4 keys" in info.value.message


def test_flags_nobody_asked_for_and_hit_runs_past_the_keys_are_an_error(fake: Fake) -> None:
    """A plain Lookup of given keys counting more hits than keys made ``batch_exists`` answer
    more pages than SGLang asked about."""
    fake.answers.lookup = pb.LookupResponse(in_l2=[True], cached=[True])
    with HiCacheClient(fake.target) as client:
        session = client.attach(WorkerIdentity("w"), [], heartbeat=False)
        with pytest.raises(HiCacheError) as unasked:
            session.lookup(["k0"])
        fake.answers.lookup = pb.LookupResponse(l2_hit_pages=1, total_hit_pages=2**40)
        with pytest.raises(HiCacheError) as long_run:
            session.lookup(["k0", "k1"])
    assert unasked.value.code == long_run.value.code == grpc.StatusCode.INTERNAL
    assert "a hit run of 1099511627776 pages for 2 keys" in long_run.value.message


def test_a_token_chains_hit_run_past_its_derived_keys_is_an_error(fake: Fake) -> None:
    """Fails before: only a Lookup of given keys had its hit run checked, so a chain of 32
    tokens answered with two derived keys and 2**40 hits was returned as a 2**40-page hit
    (the adapters clamp it; any other caller indexed past the keys). More derived keys than
    the chain has tokens cannot be an answer either."""
    chain = TokenChain(token_ids=list(range(32)))
    fake.answers.lookup = pb.LookupResponse(keys=["a", "b"], l2_hit_pages=2, total_hit_pages=2**40)
    with HiCacheClient(fake.target) as client:
        session = client.attach(WorkerIdentity("w"), [], heartbeat=False)
        with pytest.raises(HiCacheError) as long_run:
            session.lookup(chain)
        fake.answers.lookup = pb.LookupResponse(keys=["k"] * 33, l2_hit_pages=1, total_hit_pages=1)
        with pytest.raises(HiCacheError) as many_keys:
            session.lookup(chain)
        ids = list(range(32))

        def honest_answer_then_the_caller_clears_its_list(req: pb.LookupRequest) -> pb.LookupResponse:
            ids.clear()  # the caller's list changes while the call waits: the answer is to what was sent
            return pb.LookupResponse(keys=["a", "b"], l2_hit_pages=1, total_hit_pages=2)

        fake.answers.lookup = honest_answer_then_the_caller_clears_its_list
        honest = session.lookup(TokenChain(token_ids=ids))
    assert long_run.value.code == many_keys.value.code == grpc.StatusCode.INTERNAL
    assert "a hit run of 1099511627776 pages for 2 keys" in long_run.value.message
    assert "33 keys for 32 tokens" in many_keys.value.message
    assert (honest.keys, honest.l2_hit_pages, honest.total_hit_pages) == (("a", "b"), 1, 2)


def test_an_answer_past_the_receive_limit_is_refused_before_it_is_parsed(fake: Fake) -> None:
    """Fails before: the client accepted answers up to its 256 MiB message limit, parsed and
    converted whole, so one GetBytes answer could make the worker allocate that much per call.
    The default is now 64 MiB (the most a daemon at its defaults sends); ``max_receive_bytes``
    sets it."""
    fake.answers.get_bytes = lambda req: pb.GetBytesResponse(
        hit_pages=1, pages=[tpb.PageBytes(key="k", pool="kv", data=bytes(65 << 20))]
    )
    with HiCacheClient(fake.target) as client:
        session = client.attach(WorkerIdentity("w"), [], heartbeat=False)
        with pytest.raises(HiCacheError) as big:
            session.get_bytes(["k"])
    fake.answers.get_bytes = lambda req: pb.GetBytesResponse(
        hit_pages=1, pages=[tpb.PageBytes(key="k", pool="kv", data=bytes(2 << 20))]
    )
    with HiCacheClient(fake.target, max_receive_bytes=1 << 20) as client:
        session = client.attach(WorkerIdentity("w"), [], heartbeat=False)
        with pytest.raises(HiCacheError) as small:
            session.get_bytes(["k"])
    assert big.value.code == small.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (big.value, small.value)
