"""A refusal quotes at most a short prefix of a client's id (``hicached.errors.clip``).

On the code before, NOT_FOUND for an unknown backup, session, prefetch or pool repeated the
client's id whole: a 200-character backup_id came back as 200 characters of the message.
Now each keeps its status and quotes the id's first 32 characters and its length.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Transfer, WorkerIdentity, _calls, pool_spec

from tests.support.daemon import Daemon
from tests.support.kv import unique_tag

LONG = "id-" + "0123456789abcdefghij" * 10  # 203 characters, all valid in an id


def test_refusals_quote_only_a_prefix_of_a_long_id(daemon: Daemon) -> None:
    spec = pool_spec("kv", role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1,
                     num_heads=2, head_dim=16, k_buffers=[], host_bytes=1 << 20)  # fmt: skip
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        session = client.attach(WorkerIdentity(unique_tag("w"), 1, "m-clip"), [spec], heartbeat=False)
        try:
            secret = session.info.session_secret
            calls: dict[str, tuple[grpc.StatusCode, Callable[[], object]]] = {
                "RetractDiscard": (grpc.StatusCode.NOT_FOUND, lambda: session.retract_discard(LONG)),
                "RetractRestore": (
                    grpc.StatusCode.NOT_FOUND,
                    lambda: session.retract_restore_wait(LONG, [Transfer("kv", [0])]),
                ),
                "Heartbeat": (
                    grpc.StatusCode.NOT_FOUND,
                    lambda: client.invoke(_calls.heartbeat(LONG).signed(secret), None),
                ),
                "PrefetchStatus": (grpc.StatusCode.NOT_FOUND, lambda: session.prefetch_status(LONG)),
                "Write": (grpc.StatusCode.NOT_FOUND, lambda: session.write([Transfer(LONG, [0], [0])])),
            }
            wrong = []
            for name, (code, call) in calls.items():
                with pytest.raises(HiCacheError) as refused:
                    call()
                message = refused.value.message
                clipped = LONG[:32] in message and f"({len(LONG)} chars)" in message
                if refused.value.code != code or LONG[:40] in message or not clipped or len(message) >= 300:
                    wrong.append(f"{name}: {refused.value.code.name} {message}")
            assert not wrong, "\n".join(wrong)
        finally:
            session.detach()


def test_an_over_long_tenant_inside_a_key_source_is_invalid_argument(daemon: Daemon) -> None:
    """Fails before (a review of stop 46): ``KeySource.tenant`` escaped the identifier length
    check of a top-level ``tenant`` and met the tenant check first, PERMISSION_DENIED; it is
    INVALID_ARGUMENT naming ``limits.max_identity_bytes``, as docs/limits.md says."""
    spec = pool_spec("kv", role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1,
                     num_heads=2, head_dim=16, k_buffers=[], host_bytes=1 << 20)  # fmt: skip
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        session = client.attach(WorkerIdentity(unique_tag("w"), 1, "m-clip"), [spec], heartbeat=False)
        try:
            call = _calls.lookup(session.session_id, ["k"], "Q" * 100_000)
            with pytest.raises(HiCacheError) as refused:
                client.invoke(call.signed(session.info.session_secret), None)
            err = refused.value
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err
            assert "keys.tenant" in err.message and "limits.max_identity_bytes" in err.message, err
            assert "(100000 chars)" in err.message and len(err.message) < 300, err
        finally:
            session.detach()
