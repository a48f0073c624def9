"""Page keys: byte-compatible with SGLang's storage hashing.

The literal vectors below were computed outside this code base, with
``xxd -r -p | sha256sum`` over hand-written byte strings (noted per vector).
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from hicached.errors import InvalidArgument
from hicached.page_keys import chain_seed, page_digest, page_keys

# sha256(01000000 02000000), then sha256(<first digest> 03000000)
UNSEEDED_1_2_3 = [
    "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f",
    "3ac5d352be720e428633fe34fc74591b2b80060a7764e195d8f34068203ae98f",
]
# sha256(ff 0100000000000000 0000000001000000): one id >= 2**32 widens the page
WIDE_1_2POW32 = "66af2f218931e670270f1b4ea79f49befb670188f60c94856ed7a1743298f181"
# sha256("sglang-cache-namespace-v1" 01 0100000000000000 "a" 00)
SEED_A_NONE = "ad5aea43603f2a5d7b3cb72eb67799416dc43601e325d412f7afecb939b9046f"
# sha256(<SEED_A_NONE raw> 07000000)
SEEDED_A_7 = "a34d3efe91d95a85d5c06b3eff554713964d3de0083c2d7b9108f4fb87d9c8c0"
# sha256("sglang-cache-namespace-v1" 00 01 0000000000000000)
SEED_NONE_EMPTY = "906782eeabf820a68eef4455ab98e5e86e311f658f7d7721723a97a90b81427e"
# sha256(<SEED_NONE_EMPTY raw> 07000000)
SEEDED_NONE_EMPTY_7 = "39085bfa8fe0226ee5e5dda77f4392b7d500bfd174375833799c25f4f260cff2"


def test_independent_vectors() -> None:
    assert page_keys([1, 2, 3], 2) == UNSEEDED_1_2_3
    assert page_keys([1, 2**32], 2) == [WIDE_1_2POW32]
    assert chain_seed("a", None) == bytes.fromhex(SEED_A_NONE)
    assert page_keys([7], 4, extra_key="a") == [SEEDED_A_7]
    assert chain_seed(None, "") == bytes.fromhex(SEED_NONE_EMPTY)
    assert page_keys([7], 4, cache_salt="") == [SEEDED_NONE_EMPTY_7]


def test_chain_property() -> None:
    tokens = list(range(100, 110))
    keys = page_keys(tokens, 4)
    first = page_digest(None, tokens[:4])
    assert first.hex() == keys[0]
    second = page_digest(first, tokens[4:8])
    assert second.hex() == keys[1]
    assert page_digest(second, tokens[8:]).hex() == keys[2]


def test_matches_struct_reference() -> None:
    tokens = [0, 1, 2**31, 2**32 - 1, 5, 6, 7]
    prior = b""
    expected = []
    for start in range(0, len(tokens), 3):
        chunk = tokens[start : start + 3]
        prior = hashlib.sha256(prior + struct.pack(f"<{len(chunk)}I", *chunk)).digest()
        expected.append(prior.hex())
    assert page_keys(tokens, 3) == expected


def test_partial_pages() -> None:
    tokens = [1, 2, 3, 4, 5]
    assert len(page_keys(tokens, 2)) == 3
    assert page_keys(tokens, 2, include_partial=False) == page_keys(tokens, 2)[:2]
    assert page_keys(tokens[:4], 2) == page_keys(tokens, 2)[:2]
    assert page_keys([1, 2, 3], 4) == [page_digest(None, [1, 2, 3]).hex()]
    assert page_keys([1, 2, 3], 4, include_partial=False) == []
    assert page_keys([], 4) == []


def test_large_ids_only_widen_their_page() -> None:
    tokens = [1, 2, 2**40, 3, 4, 5]
    keys = page_keys(tokens, 2)
    d1 = hashlib.sha256(struct.pack("<2I", 1, 2)).digest()
    d2 = hashlib.sha256(d1 + b"\xff" + struct.pack("<2Q", 2**40, 3)).digest()
    d3 = hashlib.sha256(d2 + struct.pack("<2I", 4, 5)).digest()
    assert keys == [d1.hex(), d2.hex(), d3.hex()]
    assert page_keys([2**64 - 1], 1) == [hashlib.sha256(b"\xff" + b"\xff" * 8).hexdigest()]


def test_seed_separation() -> None:
    tokens = [1, 2, 3, 4]
    variants = [
        (None, None),
        ("a", "bc"),
        ("ab", "c"),
        ("abc", None),
        (None, "abc"),
        ("", None),
        (None, ""),
        ("", ""),
    ]
    keys = {page_keys(tokens, 2, extra_key=e, cache_salt=s)[0] for e, s in variants}
    assert len(keys) == len(variants)
    assert chain_seed(None, None) is None
    seeded = page_keys(tokens, 2, extra_key="t")
    seed = chain_seed("t", None)
    assert seeded[0] == page_digest(seed, [1, 2]).hex()
    assert seeded[1] == page_digest(bytes.fromhex(seeded[0]), [3, 4]).hex()


def test_utf8_namespace() -> None:
    manual = hashlib.sha256(b"sglang-cache-namespace-v1")
    raw = "é".encode()
    manual.update(b"\x01" + len(raw).to_bytes(8, "little") + raw + b"\x00")
    assert chain_seed("é", None) == manual.digest()


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_bad_page_size(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="page_size"):
        page_keys([1], bad)  # type: ignore[arg-type]


def test_bad_tokens_and_prior() -> None:
    with pytest.raises(InvalidArgument, match="-5"):
        page_keys([1, -5], 2)
    with pytest.raises(InvalidArgument, match=str(2**64)):
        page_keys([2**64], 2)
    with pytest.raises(InvalidArgument, match="not an int"):
        page_keys([1, "x"], 2)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="32 bytes"):
        page_digest(b"short", [1])
