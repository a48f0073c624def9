"""hicached_client.pathwalk resolves a path as the kernel does, keeping every step: the path
checks of the daemon and of the client judge the owners of what it returns."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hicached_client.pathwalk import MAX_LINKS, walk


def test_dotdot_after_a_symlink_is_the_parent_of_its_target(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "link").symlink_to(tmp_path / "a" / "b")
    (tmp_path / "a" / "x").write_text("x")
    found = walk(f"{tmp_path}/c/link/../x")
    assert found.final is not None and found.reached == str(tmp_path / "a" / "x")
    assert os.path.realpath(f"{tmp_path}/c/link/../x") == found.reached  # the kernel's answer
    met = [step.path for step in found.steps]
    assert str(tmp_path / "c" / "link") in met and str(tmp_path / "a" / "b") in met
    assert os.path.abspath(f"{tmp_path}/c/link/../x") not in met  # the text's answer, wrong


def test_every_symlink_of_a_chain_is_a_step(tmp_path: Path) -> None:
    (tmp_path / "real").write_text("x")
    (tmp_path / "hops").mkdir()
    (tmp_path / "hops" / "two").symlink_to("../real")  # relative: from the link's directory
    (tmp_path / "one").symlink_to(tmp_path / "hops" / "two")
    found = walk(str(tmp_path / "one"))
    links = [step.path for step in found.steps if step.symlink]
    assert links == [str(tmp_path / "one"), str(tmp_path / "hops" / "two")]
    assert str(tmp_path / "hops") in [step.path for step in found.steps if step.directory]
    assert found.reached == str(tmp_path / "real")


def test_a_relative_path_starts_at_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "d").mkdir()
    monkeypatch.chdir(tmp_path)
    found = walk("d/./missing/deeper")
    assert found.final is None and found.reached == str(tmp_path / "d")
    assert found.remaining == ("missing", "deeper") and found.missing == str(tmp_path / "d" / "missing")
    assert found.steps[0].path == "/"


def test_loops_and_files_passed_through_are_errors(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(OSError) as info:
        walk(str(tmp_path / "loop"))
    assert info.value.errno == errno.ELOOP
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError) as info:
        walk(str(tmp_path / "file" / "below"))
    assert info.value.errno == errno.ENOTDIR
    for i in range(MAX_LINKS):  # exactly the kernel's bound still resolves
        (tmp_path / f"l{i}").symlink_to(tmp_path / (f"l{i + 1}" if i + 1 < MAX_LINKS else "file"))
    assert walk(str(tmp_path / "l0")).reached == str(tmp_path / "file")
