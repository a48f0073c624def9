"""Content keys of L3 pages, byte-compatible with SGLang HiCache storage keys.

A page key is the hex SHA-256 of (prior page's raw 32-byte digest || the page's
token ids). Token ids are encoded as little-endian uint32 words; a page that
holds any id above 2**32 - 1 is encoded as one 0xFF marker byte followed by
little-endian uint64 words instead, so small-vocabulary pages keep the
historical encoding. The chain starts either unseeded (no prior) or from a
namespace seed derived from ``(extra_key, cache_salt)``, which keeps tenants'
chains apart (sglang#26747): two tenants never produce the same key for the
same tokens.

Pure functions: no I/O, no global state, safe from any thread.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

from hicached.errors import InvalidArgument

__all__ = ["NAMESPACE_TAG", "chain_seed", "page_digest", "page_keys"]

NAMESPACE_TAG = b"sglang-cache-namespace-v1"
_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF
_WIDE_MARKER = b"\xff"
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def chain_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The raw 32-byte seed that stands in for the first page's prior digest.

    ``None`` when both parts are absent, so untenanted chains stay identical to
    SGLang's unseeded keys. Each part is framed by presence and byte length, so
    ``("a", "bc")``, ``("ab", "c")``, ``("", None)`` and ``(None, "")`` all differ.
    """
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(NAMESPACE_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        if not isinstance(part, str):
            raise InvalidArgument(f"namespace part must be a str or None, got {part!r}")
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        words = array("I", token_ids)
        marker = b""
    except OverflowError:
        # Either an id above uint32 (switch the page to uint64 words) or a
        # negative id (rejected below with the offending value named).
        bad = next((t for t in token_ids if t < 0 or t > _U64_MAX), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside [0, 2**64 - 1]") from None
        words = array("Q", token_ids)
        marker = _WIDE_MARKER
    except TypeError:
        bad_type = next(t for t in token_ids if not isinstance(t, int))
        raise InvalidArgument(f"token id {bad_type!r} is not an int") from None
    if words.itemsize not in (4, 8):  # pragma: no cover - exotic platforms
        raise InvalidArgument(f"unsupported array itemsize {words.itemsize}")
    if _BIG_ENDIAN_HOST:  # pragma: no cover - we run on little-endian hosts
        words.byteswap()
    return marker + words.tobytes()


def page_digest(prior: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Raw 32-byte digest of one page given the previous page's raw digest.

    ``prior`` is ``None`` for the first page of an unseeded chain, or the seed
    from :func:`chain_seed` for the first page of a namespaced one.
    """
    if prior is not None and len(prior) != 32:
        raise InvalidArgument(f"prior digest must be 32 bytes, got {len(prior)}")
    hasher = hashlib.sha256()
    if prior is not None:
        hasher.update(prior)
    hasher.update(_encode_tokens(token_ids))
    return hasher.digest()


def page_keys(
    token_ids: Sequence[int],
    page_size: int,
    *,
    extra_key: str | None = None,
    cache_salt: str | None = None,
    include_partial: bool = True,
) -> list[str]:
    """Hex keys of every page of ``token_ids``, in prefix order.

    The trailing partial page gets a key too unless ``include_partial`` is
    false. Returns an empty list for an empty sequence.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise InvalidArgument(f"page_size must be a positive int, got {page_size!r}")
    prior = chain_seed(extra_key, cache_salt)
    n = len(token_ids)
    end = n if include_partial else n - n % page_size
    keys: list[str] = []
    for start in range(0, end, page_size):
        prior = page_digest(prior, token_ids[start : min(start + page_size, end)])
        keys.append(prior.hex())
    return keys
