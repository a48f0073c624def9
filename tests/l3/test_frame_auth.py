"""Authenticated frames (``l3.auth_key_file``): the codec, the tenant tag, and each shared backend.

The defect (reviewer, on main): a frame's key hash and checksum were unkeyed XXH3s and the
tenant tag a public SHA-256, so any writer of a shared L3 could compute a tenant's object
names and valid frames of its own bytes under them. These tests need the keyed codec and
tag, which main does not have (they fail there at import).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import uuid
from collections.abc import Callable, Iterator

import pytest

from hicached.core.tenants import scoped_keys, tenant_tag
from hicached.l3 import StorageBackend
from hicached.l3.framing import (
    AUTH_HEADER,
    FRAME_HEADER,
    PLAIN,
    FrameCodec,
    L3Key,
    frame,
    unframe,
)
from hicached.l3.registry import build_config, open_backend
from hicached.testing.servers import MooncakeMaster, RedisServer, SeaweedFS

from .test_mooncake_fixtures import mc_options
from .test_s3_fixtures import s3_options

KEY = "hicached/0123abcd/kv/page-7~" + "ab" * 16
PAGE = bytes(range(256)) * 16


def keys(seed: int) -> L3Key:
    return L3Key.from_secret(hashlib.sha256(f"secret {seed}".encode()).hexdigest().encode())


@pytest.fixture
def codec() -> FrameCodec:
    return FrameCodec(keys(1).frame_key)


# ---- the codec ---------------------------------------------------------------------------


def test_an_authenticated_frame_round_trips(codec: FrameCodec) -> None:
    blob = codec.frame(KEY, [PAGE[:1000], memoryview(PAGE)[1000:]])
    assert len(blob) == AUTH_HEADER.size + len(PAGE) == codec.header_size + len(PAGE)
    payload, why = codec.verify(KEY, blob)
    assert payload is not None and bytes(payload) == PAGE and why == ""
    assert codec.header(KEY, [PAGE]) == blob[: codec.header_size]
    assert PLAIN.header_size == FRAME_HEADER.size
    assert bytes(PLAIN.unframe(KEY, frame(KEY, [PAGE])) or b"") == PAGE  # plain frames still work


def test_a_frame_forged_without_the_key_is_refused(codec: FrameCodec) -> None:
    """What an L3 writer can make without the secret: the plain frame main accepted, and a
    version-2 frame with a MAC of its own (unkeyed, or keyed with a guess)."""
    plain = frame(KEY, [PAGE])
    assert unframe(KEY, plain) is not None  # the forgery main served
    payload, why = codec.verify(KEY, plain)
    assert payload is None and "unauthenticated frame" in why
    common = struct.pack("<4sHHQ", b"HCP1", 2, 0, len(PAGE))
    for mac in (
        hashlib.sha256(common + KEY.encode() + PAGE).digest(),
        hmac.digest(b"\0" * 32, common + KEY.encode() + PAGE, "sha256"),
        bytes(32),
    ):
        payload, why = codec.verify(KEY, common + mac + PAGE)
        assert payload is None and "MAC mismatch" in why


def test_a_frame_with_the_wrong_key_is_refused(codec: FrameCodec) -> None:
    other = FrameCodec(keys(2).frame_key)
    payload, why = codec.verify(KEY, other.frame(KEY, [PAGE]))
    assert payload is None and "MAC mismatch" in why and "l3.auth_key_file" in why


def test_the_mac_binds_key_length_and_every_byte(codec: FrameCodec) -> None:
    blob = codec.frame(KEY, [PAGE])
    assert codec.unframe(KEY.replace("page-7", "page-8"), blob) is None  # replayed under another name
    assert codec.unframe(KEY, blob[:-1]) is None
    assert codec.unframe(KEY, blob + b"\0") is None
    for at in (0, 4, 8, 20, AUTH_HEADER.size, len(blob) - 1):  # magic, version, length, MAC, payload
        flipped = bytearray(blob)
        flipped[at] ^= 0x01
        assert codec.unframe(KEY, flipped) is None, at
    # A shorter payload with the length field fixed up still fails its MAC.
    short = bytearray(blob[: AUTH_HEADER.size] + PAGE[:-1])
    struct.pack_into("<Q", short, 8, len(PAGE) - 1)
    assert codec.unframe(KEY, short) is None


def test_a_daemon_without_a_key_refuses_authenticated_frames_cleanly(codec: FrameCodec) -> None:
    blob = codec.frame(KEY, [PAGE])
    payload, why = PLAIN.verify(KEY, blob)
    assert payload is None and "no l3.auth_key_file" in why
    assert unframe(KEY, blob) is None
    assert PLAIN.foreign(blob) == why and codec.foreign(frame(KEY, [PAGE])) != ""
    for junk in (b"", b"HCP1", blob[:20], b"x" * 100, struct.pack("<4sHHQ", b"HCP1", 9, 0, 0)):
        assert PLAIN.unframe(KEY, junk) is None and codec.unframe(KEY, junk) is None


# ---- the key and the tenant tag ----------------------------------------------------------


def test_the_secret_must_be_long_and_is_never_shown() -> None:
    with pytest.raises(ValueError, match="at least 32 bytes"):
        L3Key.from_secret(b"x" * 31)
    key = keys(1)
    assert key.frame_key != key.tenant_key and len(key.frame_key) == 32
    assert key.frame_key.hex() not in repr(key) and "secret" in repr(key)
    assert keys(1) == key and keys(2) != key  # derived deterministically: the same on every daemon


def test_a_keyed_tenant_tag_differs_from_the_public_one_and_between_keys() -> None:
    public = tenant_tag("alice")
    keyed = tenant_tag("alice", keys(1).tenant_key)
    assert public == hashlib.sha256(b"hicached-tenant\0alice").hexdigest()[:32]  # unchanged without a key
    assert keyed != public and keyed == tenant_tag("alice", keys(1).tenant_key)
    assert tenant_tag("alice", keys(2).tenant_key) != keyed
    assert tenant_tag("bob", keys(1).tenant_key) != keyed
    assert len(keyed) == 32 and all(c in "0123456789abcdef" for c in keyed)
    assert scoped_keys("alice", ["k"], tag_key=keys(1).tenant_key) == [f"k~{keyed}"]
    assert scoped_keys("", ["k"], tag_key=keys(1).tenant_key) == ["k"]  # the default tenant has no tag


# ---- each shared backend -----------------------------------------------------------------

Opener = Callable[[FrameCodec | None], StorageBackend]


@pytest.fixture(params=["redis", "s3", "mooncake"])
def opener(request: pytest.FixtureRequest) -> Iterator[Opener]:
    """Opens backends of one kind that share one store and prefix, each with its own codec,
    as daemons sharing an L3 do."""
    name: str = request.param
    prefix = f"auth-{os.getpid()}-{uuid.uuid4().hex[:8]}/"
    if name == "redis":
        srv: RedisServer = request.getfixturevalue("redis_srv")
        options: dict[str, object] = {"port": srv.port, "key_prefix": prefix}
    elif name == "s3":
        seaweed: SeaweedFS = request.getfixturevalue("seaweed_srv")
        options = s3_options(seaweed, prefix=prefix)
    else:
        master: MooncakeMaster = request.getfixturevalue("mooncake_srv")
        options = mc_options(master, key_prefix=prefix)
    opened: list[StorageBackend] = []

    def open_one(codec: FrameCodec | None) -> StorageBackend:
        backend = open_backend(name, build_config(name, options), codec=codec)
        opened.append(backend)
        return backend

    yield open_one
    if opened:
        opened[0].clear()
    for backend in opened:
        backend.close()


def test_a_shared_backend_serves_only_frames_of_its_own_key(opener: Opener) -> None:
    mine = opener(FrameCodec(keys(1).frame_key))
    other = opener(FrameCodec(keys(2).frame_key))
    plain = opener(None)
    dest = bytearray(len(PAGE))

    # A holder of the key round-trips, in both read paths.
    assert mine.set(["p/ok", "p/mismatch", "p/plain"], [PAGE, PAGE, PAGE]) == [True] * 3
    assert mine.get(["p/ok"]) == [PAGE]
    assert mine.get_into(["p/ok"], [[memoryview(dest)]]) == [True] and dest == PAGE

    # Another key, or none: a miss, no exception (the mismatch a deployment must avoid).
    before = other.stats().corrupt_pages
    assert other.get(["p/mismatch"]) == [None]
    assert other.stats().corrupt_pages == before + 1
    assert plain.get(["p/plain"]) == [None]
    assert plain.get_into(["p/ok"], [[memoryview(bytearray(len(PAGE)))]]) == [False]

    # A plain frame (what any writer can make, and main served): a counted miss, removed, so the
    # holder's own write of the page is stored rather than blocked by the forgery (SET NX).
    assert plain.set(["p/forged"], [b"\x41" * len(PAGE)]) == [True]
    before = mine.stats().corrupt_pages
    dest[:] = bytes(len(dest))
    assert mine.get_into(["p/forged"], [[memoryview(dest)]]) == [False]
    assert dest.count(0x41) < len(dest)
    assert mine.stats().corrupt_pages == before + 1
    assert mine.present(["p/forged"]) == [False]
    assert mine.set(["p/forged"], [PAGE]) == [True]
    assert mine.get(["p/forged"]) == [PAGE]
