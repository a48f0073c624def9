"""KVSpec validation, the reference size formula, and host pool sizing."""

from __future__ import annotations

import math

import pytest
import torch

from hicached.errors import InvalidArgument
from hicached.l2 import HostLayout, KVSpec, PoolKind, host_pages_for
from hicached.l2.layout import LAYOUTS, layout_for


def test_mha_size_per_token_is_the_reference_formula() -> None:
    spec = KVSpec(PoolKind.MHA, torch.bfloat16, num_layers=61, num_heads=8, head_dim=128, page_size=64)
    assert spec.num_kv == 2
    assert spec.size_per_token == (128 + 128) * 8 * 61 * 2
    assert spec.page_bytes == spec.size_per_token * 64


def test_mla_stores_one_latent_per_token() -> None:
    spec = KVSpec(PoolKind.MLA, torch.float8_e4m3fn, num_layers=61, num_heads=1, head_dim=576, page_size=64)
    assert spec.num_kv == 1
    assert spec.size_per_token == 576 * 61 * 1
    assert spec.page_bytes == 576 * 61 * 64


def test_mha_v_head_dim_equal_or_zero_is_accepted() -> None:
    spec = KVSpec(PoolKind.MHA, torch.float16, 2, 2, 64, 16, v_head_dim=64)
    assert spec.size_per_token == 2 * 64 * 2 * 2 * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_heads": -2}, "num_heads"),
        ({"head_dim": 1.5}, "head_dim"),
        ({"page_size": 0}, "page_size"),
        ({"v_head_dim": 96}, "v_head_dim=96 differs from head_dim=64"),
        ({"v_head_dim": -1}, "v_head_dim"),
        ({"kind": "gqa"}, "'gqa'"),
        ({"dtype": "bfloat16"}, "dtype"),
    ],
)
def test_bad_spec_names_field_and_value(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "kind": PoolKind.MHA,
        "dtype": torch.bfloat16,
        "num_layers": 2,
        "num_heads": 2,
        "head_dim": 64,
        "page_size": 16,
    }
    base.update(kwargs)
    with pytest.raises(InvalidArgument, match=message):
        KVSpec(**base)  # type: ignore[arg-type]


def test_mla_rules() -> None:
    with pytest.raises(InvalidArgument, match="num_heads must be 1 for an MLA pool, got 4"):
        KVSpec(PoolKind.MLA, torch.bfloat16, 2, 4, 576, 64)
    with pytest.raises(InvalidArgument, match="v_head_dim must be 0 for an MLA pool, got 512"):
        KVSpec(PoolKind.MLA, torch.bfloat16, 2, 1, 576, 64, v_head_dim=512)


def test_kind_given_as_string_is_normalised() -> None:
    spec = KVSpec("mla", torch.bfloat16, 2, 1, 8, 4)  # type: ignore[arg-type]
    assert spec.kind is PoolKind.MLA


def test_sizing_by_ratio_matches_the_reference() -> None:
    spec = KVSpec(PoolKind.MHA, torch.bfloat16, 4, 2, 64, 16)
    # Reference: size = int(device * ratio) tokens, page_num = size // page_size (+1 padding).
    assert host_pages_for(spec, device_tokens=1000, ratio=2.0) == 2000 // 16
    assert host_pages_for(spec, device_tokens=1000, ratio=0.5) == 500 // 16


def test_sizing_by_bytes_rounds_down_to_whole_pages() -> None:
    spec = KVSpec(PoolKind.MHA, torch.bfloat16, 4, 2, 64, 16)
    nbytes = 10 * spec.page_bytes + spec.page_bytes - 1
    assert host_pages_for(spec, device_tokens=0, nbytes=nbytes) == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ratio": 2.0, "nbytes": 1 << 20}, "exactly one"),
        ({}, "exactly one"),
        ({"ratio": 0.0}, "ratio"),
        ({"ratio": math.nan}, "nan"),
        ({"nbytes": -5}, "-5"),
        ({"nbytes": 100}, "0 host pages"),
        ({"ratio": 0.001}, "0 host pages"),
    ],
)
def test_bad_sizing_raises(kwargs: dict[str, float], message: str) -> None:
    spec = KVSpec(PoolKind.MHA, torch.bfloat16, 4, 2, 64, 16)
    with pytest.raises(InvalidArgument, match=message):
        host_pages_for(spec, device_tokens=1000, **kwargs)  # type: ignore[arg-type]


def test_negative_device_tokens_rejected() -> None:
    spec = KVSpec(PoolKind.MHA, torch.bfloat16, 4, 2, 64, 16)
    with pytest.raises(InvalidArgument, match="-1"):
        host_pages_for(spec, device_tokens=-1, ratio=2.0)


def test_every_layout_has_a_geometry_and_unknown_is_rejected() -> None:
    assert set(LAYOUTS) == set(HostLayout)
    with pytest.raises(InvalidArgument, match="'page_head'"):
        layout_for("page_head")


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (HostLayout.LAYER_FIRST, (2, 3, 5 * 4, 2, 8)),
        (HostLayout.PAGE_FIRST, (2, 5 * 4, 3, 2, 8)),
        (HostLayout.PAGE_FIRST_DIRECT, (2, 5, 3, 4, 2, 8)),
    ],
)
def test_layout_shapes_are_the_reference_dims(layout: HostLayout, shape: tuple[int, ...]) -> None:
    spec = KVSpec(PoolKind.MHA, torch.float16, num_layers=3, num_heads=2, head_dim=8, page_size=4)
    assert LAYOUTS[layout].shape(spec, total_pages=5) == shape


@pytest.mark.parametrize("layout", list(HostLayout))
def test_page_extents_cover_every_byte_exactly_once(layout: HostLayout) -> None:
    spec = KVSpec(PoolKind.MHA, torch.float16, num_layers=3, num_heads=2, head_dim=8, page_size=4)
    total = 5
    seen = bytearray(total * spec.page_bytes)
    for page in range(total):
        extents = LAYOUTS[layout].page_extents(spec, total, page)
        assert sum(n for _, n in extents) == spec.page_bytes
        for off, n in extents:
            assert all(b == 0 for b in seen[off : off + n])
            seen[off : off + n] = b"\x01" * n
    assert all(seen)
