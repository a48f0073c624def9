"""The daemon and the client share one wire vocabulary (issue 14 item 4).

Fails before the change: the daemon kept its own PoolRole/PoolKind/HostLayout
classes and its own dtype tables, so the identity checks below were false.
"""

from __future__ import annotations

import torch
from hicached_client import types, vocab
from hicached_client.v1 import types_pb2 as tpb

from hicached.core.types import PoolRole
from hicached.index.types import PrefetchState
from hicached.l2.layout import HostLayout, PoolKind
from hicached.server import convert
from hicached.transfer.handles import DTYPE_BY_NAME


def test_the_daemon_enums_are_the_client_enums() -> None:
    assert PoolRole is vocab.PoolRole is types.PoolRole
    assert PoolKind is vocab.PoolKind is types.PoolKind
    assert HostLayout is vocab.HostLayout is types.HostLayout


def test_every_wire_dtype_has_one_torch_dtype_derived_from_the_vocabulary() -> None:
    named = {v for k, v in tpb.DataType.items() if k != "DATA_TYPE_UNSPECIFIED"}
    assert set(vocab.DATA_TYPES.values()) == named == set(convert.DTYPES)
    for name, dtype in DTYPE_BY_NAME.items():
        assert str(dtype) == f"torch.{name}" and isinstance(dtype, torch.dtype)
    assert convert.DTYPES[tpb.DATA_TYPE_BFLOAT16] is torch.bfloat16


def test_the_daemon_tables_are_the_inverses_of_the_client_tables() -> None:
    assert {w: e for e, w in vocab.POOL_ROLES.items()} == convert.ROLES
    assert {w: e for e, w in vocab.POOL_KINDS.items()} == convert.KINDS
    assert {w: e for e, w in vocab.HOST_LAYOUTS.items()} == convert.LAYOUTS


def test_the_daemon_prefetch_state_is_the_client_one() -> None:
    """Fails before the change: the content index kept its own PrefetchState class."""
    assert PrefetchState is vocab.PrefetchState is types.PrefetchState
