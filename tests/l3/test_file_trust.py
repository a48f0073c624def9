"""The file backend's directory is trusted by its permissions (it has no ``l3.auth_key_file``).

Its pages carry checksums, not MACs: whoever can write the directory can plant a slab file
of pages the daemon serves to every tenant. Before, the directory was made under the umask
(0755 under 022) and any existing one was used as found, 0777 or another user's included.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hicached.errors import FailedPrecondition
from hicached.l3 import create_backend
from hicached.l3.file import slot_bytes_for

OPTIONS = {"capacity_bytes": 1 << 20}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_directory_is_private_whatever_the_umask(file_dir: Path) -> None:
    old = os.umask(0o002)
    try:
        create_backend("file", {"path": str(file_dir), **OPTIONS}).close()
    finally:
        os.umask(old)
    assert mode(file_dir) == 0o700
    assert {mode(p) for p in file_dir.iterdir()} == {0o600}


def test_an_own_directory_with_wider_bits_is_narrowed(file_dir: Path) -> None:
    file_dir.mkdir(parents=True)
    file_dir.chmod(0o775)
    create_backend("file", {"path": str(file_dir), **OPTIONS}).close()
    assert mode(file_dir) == 0o700


@pytest.mark.parametrize("bits", [0o777, 0o1777, 0o703])
def test_a_directory_others_can_write_is_refused(file_dir: Path, bits: int) -> None:
    file_dir.mkdir(parents=True)
    file_dir.chmod(bits)
    with pytest.raises(FailedPrecondition, match="writable by others"):
        create_backend("file", {"path": str(file_dir), **OPTIONS})
    assert mode(file_dir) == bits & 0o7777 and list(file_dir.iterdir()) == []


def test_a_directory_of_another_user_is_refused(file_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root to give the directory to another uid: run the suite as root, as CI does")
    file_dir.mkdir(parents=True, mode=0o700)
    os.chown(file_dir, 65534, 65534)
    with pytest.raises(FailedPrecondition, match="owned by uid 65534"):
        create_backend("file", {"path": str(file_dir), **OPTIONS})


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_slab_name_that_is_no_regular_file_is_never_written_through(file_dir: Path, kind: str) -> None:
    """The start-up scan ignored a slab file that is a symlink or a FIFO, but the first page of
    that size opened it anyway (following the symlink: the page went to its target, and the
    next start ignored it; a FIFO blocked the write). Now that size is not stored."""
    backend = create_backend("file", {"path": str(file_dir), **OPTIONS})
    try:
        assert backend.set(["a"], [b"x" * 100]) == [True]  # makes the directory, one slab
        size = slot_bytes_for(10_000)
        outside = file_dir.parent / "outside"
        outside.write_bytes(b"")
        name = file_dir / f"slab-{size}.dat"
        if kind == "symlink":
            name.symlink_to(outside)
        else:
            os.mkfifo(name, 0o600)
        assert backend.set(["b"], [b"y" * 10_000]) == [False]
        assert outside.read_bytes() == b""
        assert backend.get(["a", "b"]) == [b"x" * 100, None]
    finally:
        backend.close()
