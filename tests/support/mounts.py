"""Filesystems a test mounts for itself (CI runs as root with util-linux)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["attach_loop", "detach_loop", "mount", "unmount"]


def mount(target: Path, *args: str) -> str | None:
    """``mount ARGS TARGET``; None on success, else the reason it was refused (fails the test
    when there is no mount command at all)."""
    if shutil.which("mount") is None:
        pytest.fail("no mount command: install util-linux (CI runs as root with it)")
    done = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


def unmount(target: Path) -> None:
    """Lazily unmount ``target`` (a test's file left open must not keep it mounted)."""
    subprocess.run(["umount", "-l", str(target)], check=False)


def attach_loop(image: Path, *, sector_bytes: int) -> str:
    """A loop device over ``image`` with ``sector_bytes`` logical sectors (``losetup``); fails
    the test where loop devices cannot be made (CI runs as root with util-linux)."""
    done = subprocess.run(
        ["losetup", "--find", "--show", "--sector-size", str(sector_bytes), str(image)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"cannot attach a loop device (CI runs as root): {done.stderr.strip()}")
    return done.stdout.strip()


def detach_loop(device: str) -> None:
    subprocess.run(["losetup", "--detach", device], check=False)
