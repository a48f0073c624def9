"""SharedSegment: named /dev/shm segments whose lifetime the daemon owns."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicached.errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied
from hicached.l2 import SharedSegment


def test_create_is_zeroed_and_shared_between_mappings(shm_name: Callable[[], str]) -> None:
    name = shm_name()
    with SharedSegment.create(name, 3 * 4096) as seg, SharedSegment.open(name) as other:
        assert seg.size == other.size == 3 * 4096
        assert bytes(seg.buf[:16]) == bytes(16)
        seg.buf[100:104] = b"abcd"
        assert bytes(other.buf[100:104]) == b"abcd"


def test_create_refuses_a_taken_name_and_leaves_it_intact(shm_name: Callable[[], str]) -> None:
    name = shm_name()
    with SharedSegment.create(name, 4096) as seg:
        seg.buf[0:3] = b"xyz"
        with pytest.raises(AlreadyExists, match=name):
            SharedSegment.create(name, 8192)
        with SharedSegment.open(name) as again:
            assert again.size == 4096
            assert bytes(again.buf[0:3]) == b"xyz"


def test_open_missing_segment_raises_not_found(shm_name: Callable[[], str]) -> None:
    name = shm_name()
    with pytest.raises(NotFound, match=name):
        SharedSegment.open(name)


def test_open_refuses_a_symlink_planted_under_the_daemons_name(
    shm_name: Callable[[], str], tmp_path: Path
) -> None:
    """Before: open() followed the link and mapped the target read-write (issue 9, attack 1)."""
    target = tmp_path / "secret"
    target.write_bytes(b"s" * 4096)
    link = Path("/dev/shm") / shm_name()
    link.symlink_to(target)
    try:
        with pytest.raises(PermissionDenied, match="symlink"):
            SharedSegment.open(link.name)
        with pytest.raises(AlreadyExists):
            SharedSegment.create(link.name, 4096)  # O_EXCL | O_NOFOLLOW: never through the link
    finally:
        link.unlink()
    assert target.read_bytes() == b"s" * 4096


def test_open_refuses_a_segment_with_a_second_name(shm_name: Callable[[], str]) -> None:
    """Fails before: a hard link of one group's segment under another group's name was mapped,
    and the two groups shared its pages (the link needs fs.protected_hardlinks=0 for another
    user; root makes it here)."""
    name, other = shm_name(), shm_name()
    with SharedSegment.create(name, 4096) as seg:
        seg.buf[0:3] = b"abc"
        os.link(Path("/dev/shm") / name, Path("/dev/shm") / other)
        try:
            for either in (name, other):
                with pytest.raises(PermissionDenied, match="2 names"):
                    SharedSegment.open(either)
        finally:
            os.unlink(Path("/dev/shm") / other)
        with SharedSegment.open(name) as again:  # one name again: its own
            assert bytes(again.buf[0:3]) == b"abc"


@pytest.mark.parametrize("bad", ["", "a/b", "..", "x" * 300])
def test_bad_names_are_rejected_by_name(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="name"):
        SharedSegment.create(bad, 4096)


@pytest.mark.parametrize("size", [0, -1])
def test_bad_size_is_rejected_and_leaves_no_segment(shm_name: Callable[[], str], size: int) -> None:
    name = shm_name()
    with pytest.raises(InvalidArgument, match=str(size)):
        SharedSegment.create(name, size)
    assert not SharedSegment.exists(name)


def test_tensor_is_a_zero_copy_view(shm_name: Callable[[], str]) -> None:
    with SharedSegment.create(shm_name(), 4096) as seg:
        t = seg.tensor(torch.int32, (4, 8), offset=64)
        t[1, 2] = 0x01020304
        offset = 64 + (1 * 8 + 2) * 4
        assert bytes(seg.buf[offset : offset + 4]) == (0x01020304).to_bytes(4, "little")


def test_tensor_that_does_not_fit_names_the_sizes(shm_name: Callable[[], str]) -> None:
    with SharedSegment.create(shm_name(), 4096) as seg:
        with pytest.raises(InvalidArgument, match="4104"):
            seg.tensor(torch.int64, (512,), offset=8)
        with pytest.raises(InvalidArgument, match="offset 3"):
            seg.tensor(torch.int32, (2,), offset=3)


def test_close_is_idempotent_and_live_views_stay_valid(shm_name: Callable[[], str]) -> None:
    seg = SharedSegment.create(shm_name(), 4096)
    t = seg.tensor(torch.uint8, (4096,))
    t[7] = 42
    seg.close()
    seg.close()
    assert seg.closed
    # The mapping is only released when the last view dies: no dangling pointer.
    assert int(t[7]) == 42
    with pytest.raises(InvalidArgument, match="closed"):
        _ = seg.buf
    del t
    gc.collect()


def test_unlink_is_idempotent_and_mappings_survive_it(shm_name: Callable[[], str]) -> None:
    name = shm_name()
    seg = SharedSegment.create(name, 4096)
    seg.buf[0] = 9
    seg.unlink()
    seg.unlink()
    assert not SharedSegment.exists(name)
    assert seg.buf[0] == 9
    seg.close()


def test_open_read_only_reads_and_refuses_writes(shm_name: Callable[[], str]) -> None:
    name = shm_name()
    with SharedSegment.create(name, 4096) as seg:
        seg.buf[5] = 77
        with SharedSegment.open(name, writable=False) as ro:
            assert not ro.writable
            assert ro.buf[5] == 77
            assert ro.buf.readonly
            with pytest.raises(TypeError):
                ro.buf[5] = 1


def test_prefault_on_open_keeps_contents(shm_name: Callable[[], str]) -> None:
    name = shm_name()
    with SharedSegment.create(name, 64 * 4096, prefault=False) as seg:
        seg.buf[4096 * 10 + 1] = 200
        with SharedSegment.open(name, prefault=True) as again:
            assert again.buf[4096 * 10 + 1] == 200


def test_segment_outlives_the_process_that_created_it(shm_name: Callable[[], str]) -> None:
    """No resource tracker: a warm restart finds what a dead process left behind."""
    name = shm_name()
    code = (
        "from hicached.l2 import SharedSegment\n"
        f"s = SharedSegment.create({name!r}, 8192)\n"
        "s.buf[4096:4101] = b'alive'\n"
        "s.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with SharedSegment.open(name) as seg:
        assert bytes(seg.buf[4096:4101]) == b"alive"
