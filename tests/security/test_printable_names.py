"""The names a worker gives the daemon are printable: they reach an admin's terminal.

On the code before, a worker attached with an ``identity.instance_id`` or a pool name made of
terminal escapes (OSC 0 window title, CSI 2J clear, OSC 52 clipboard write), and the admin's
``hicached status`` printed them raw. Only the tenant had to be printable. Now the instance id,
model name and pool names must be too (``str.isprintable``: no C0/C1 control, DEL, bidi or other
format character), as the tenant: INVALID_ARGUMENT naming the field, nothing attached.
"""

from __future__ import annotations

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, PageBytes, Transfer, WorkerIdentity, pool_spec
from hicached_client.v1 import types_pb2 as tpb

from tests.support.daemon import Daemon
from tests.support.kv import PAGE_SIZE, WorkerPools, transfers, unique_tag

ESCAPES = "\x1b]0;owned\x1b\\\x1b[2J\x1b]52;c;cm0gLXJmIH4K\x07"


def _spec(name: str = "kv") -> tpb.PoolSpec:
    return pool_spec(name, role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1,
                     num_heads=2, head_dim=16, k_buffers=[], host_bytes=1 << 20)  # fmt: skip


@pytest.mark.parametrize(
    ("field", "instance", "model", "pool", "tenant"),
    [
        ("identity.instance_id", ESCAPES, "m-print", "kv", ""),
        ("identity.model_name", "", "m-print\n", "kv", ""),
        ("identity.model_name", "", "m-\u202eprint", "kv", ""),  # a bidi override
        ("identity.model_name", "", "m-\x9b2J", "kv", ""),  # C1 CSI
        ("pools[0].name", "", "m-print", "kv" + ESCAPES, ""),
        ("identity.tenant", "", "m-print", "kv", "team" + ESCAPES),
    ],
)
def test_an_attach_with_a_name_that_is_not_printable_is_refused(
    daemon: Daemon, field: str, instance: str, model: str, pool: str, tenant: str
) -> None:
    tag = unique_tag("w")
    identity = WorkerIdentity(tag + instance, 1, model, tenant=tenant)
    with HiCacheClient(daemon.target, timeout_s=30.0) as client, HiCacheClient(daemon.admin_target) as admin:
        before = admin.get_stats()
        with pytest.raises(HiCacheError) as refused:
            client.attach(identity, [_spec(pool)], heartbeat=False)
        after = admin.get_stats()
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    message = refused.value.message
    assert message.startswith(field + " "), message
    assert "must be printable" in message, message
    assert not any(ch in message for ch in "\x1b\x07\n\x7f\x9b\u202e"), ascii(message)  # quoted escaped
    assert not [s for s in after.sessions if s.identity.instance_id.startswith(tag)]
    assert len(after.groups) == len(before.groups) and after.host_used_bytes == before.host_used_bytes


def test_a_transfer_or_page_naming_a_pool_that_is_not_printable_is_refused(daemon: Daemon) -> None:
    """Before: NOT_FOUND (no such pool); now the name itself is refused, naming where it was.
    Printable is not ASCII: names with spaces, accents and CJK attach as before."""
    identity = WorkerIdentity(unique_tag("wörker"), 1, "Modèle 7B (été) 模型", tenant="équipe a")
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        session = client.attach(identity, [_spec("池")], heartbeat=False)
        try:
            calls = {
                "transfers[0].pool": lambda: session.write([Transfer("池" + ESCAPES, [0], [0])]),
                "pages[0].pool": lambda: session.put_bytes([PageBytes("k" * 64, "池\r", b"\0" * 512)]),
            }
            for field, call in calls.items():
                with pytest.raises(HiCacheError) as refused:
                    call()
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, (field, refused.value)
                assert refused.value.message.startswith(field + " "), refused.value.message
                assert "must be printable" in refused.value.message, refused.value.message
        finally:
            session.detach()


def test_a_retraction_backup_with_a_request_id_that_is_not_printable_is_refused(daemon: Daemon) -> None:
    """A backup's request id is listed by ``hicached status``: before, only its length was
    checked (the CLI escapes it; an older CLI would not)."""
    pools = WorkerPools.create(unique_tag("print"))
    try:
        with (
            HiCacheClient(daemon.target, timeout_s=30.0) as client,
            HiCacheClient(daemon.admin_target) as admin,
        ):
            identity = WorkerIdentity(unique_tag("w"), 1, "m-print-backup")
            with client.attach(identity, pools.specs(), heartbeat=False) as session:
                with pytest.raises(HiCacheError) as refused:
                    session.retract_backup("req" + ESCAPES, transfers([10, 11]), 2 * PAGE_SIZE)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, refused.value
                assert refused.value.message.startswith("request_id "), refused.value.message
                assert "must be printable" in refused.value.message, refused.value.message
                assert not admin.get_stats().backups
                assert session.retract_backup("req-printable", transfers([10, 11]), 2 * PAGE_SIZE).ok
    finally:
        pools.close()


def test_a_pool_named_like_a_group_id_in_a_segment_name_is_refused(daemon: Daemon) -> None:
    """A warm-restart segment is ``<prefix>-<group id>-<pool>``: a pool named
    ``<16 hex>-...`` would make its segments look like another shm prefix's, which a daemon
    leaves alone at its start (so a crashed group's segments would stay)."""
    identity = WorkerIdentity(unique_tag("w"), 1, "m-segment-like")
    with HiCacheClient(daemon.target, timeout_s=30.0) as client:
        with pytest.raises(HiCacheError) as refused:
            client.attach(identity, [_spec("0123456789abcdef-kv")], heartbeat=False)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "must not start with 16 hex digits" in refused.value.message
        client.attach(identity, [_spec("0123456789abcdefkv")], heartbeat=False).detach()  # not the form
