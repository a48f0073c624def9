"""The ownership records behind segment reclamation, in a scratch directory (real files, real
``flock``): only a record whose lock nobody holds frees segments, and only the cold-mode names of
its own daemon id under its own prefix."""

from __future__ import annotations

import os
from pathlib import Path

from hicached.l2.owners import OwnerRecord, reclaim_dead

GID = "0123456789abcdef"


def touch(directory: Path, name: str, size: int = 4096) -> None:
    with (directory / name).open("wb") as f:
        f.truncate(size)


def test_only_dead_owners_segments_are_reclaimed(tmp_path: Path) -> None:
    """Fails before the fix (the module did not exist: nothing reclaimed a killed daemon's segments)."""
    live = OwnerRecord("pre", "aaa1", directory=str(tmp_path))
    dead = OwnerRecord("pre", "bbb2", directory=str(tmp_path))
    other = OwnerRecord("pre-bbb2", "ccc3", directory=str(tmp_path))  # a prefix that starts like ours
    mine = [f"pre-bbb2-{GID}-kv", f"pre-bbb2-{GID}-draft"]
    kept = [
        f"pre-aaa1-{GID}-kv",  # the live daemon's
        f"pre-{GID}-kv",  # warm-restart name (the journal logic owns it)
        f"pre-bbb2-ccc3-{GID}-kv",  # the daemon of prefix "pre-bbb2"
        "pre-bbb2-notagroup",  # not a cold-mode segment name
        f"other-bbb2-{GID}-kv",
    ]
    for name in (*mine, *kept):
        touch(tmp_path, name)
    try:
        assert reclaim_dead("pre", directory=str(tmp_path)).owners == ()
        assert dead._fd is not None
        os.close(dead._fd)  # what the kernel does when the daemon is SIGKILLed: the lock drops
        dead._fd = None
        got = reclaim_dead("pre", directory=str(tmp_path))
        assert got.owners == ("bbb2",)
        assert sorted(got.segments) == sorted((n, 4096) for n in mine)
        assert got.nbytes == 2 * 4096
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {*kept, "pre-aaa1.owner", "pre-bbb2-ccc3.owner"}
        assert reclaim_dead("pre", directory=str(tmp_path)).owners == (), "reclaimed once"
    finally:
        live.release()
        other.release()
    assert not (tmp_path / "pre-aaa1.owner").exists(), "a clean release removes the record"
    assert reclaim_dead("pre-bbb2", directory=str(tmp_path)).owners == ()
