"""The wire contract: generated code is current, the proto lints, no pickle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_buf_lint_clean() -> None:
    buf = shutil.which("buf")
    assert buf is not None, "buf is installed by the dev extra (buf-bin)"
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_package_is_versioned_v1() -> None:
    from hicached_client.v1 import hicached_pb2

    assert hicached_pb2.DESCRIPTOR.package == "hicached.v1"
    services = set(hicached_pb2.DESCRIPTOR.services_by_name)
    assert {"HiCacheService", "AdminService"} <= services


def test_no_pickle_in_wire_code() -> None:
    offenders = []
    for base in (ROOT / "hicached", ROOT / "clients" / "python" / "hicached_client"):
        for path in base.rglob("*.py"):
            text = path.read_text()
            if "import pickle" in text or "cloudpickle" in text or "pickle.loads" in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def _copy_of_the_tree(tmp_path: Path) -> Path:
    """proto/, tools/ and the generated package: what gen_proto.py reads and writes."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "proto", root / "proto")
    shutil.copytree(ROOT / "tools", root / "tools")
    shutil.copytree(ROOT / "clients/python/hicached_client/v1", root / "clients/python/hicached_client/v1")
    return root


def _snapshot(root: Path) -> dict[str, bytes]:
    out = root / "clients/python/hicached_client"
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_regenerating_writes_the_same_code(tmp_path: Path) -> None:
    """`./dev proto` as a user runs it: the result is the checked-in code, byte for byte."""
    root = _copy_of_the_tree(tmp_path)
    before = _snapshot(root)
    done = subprocess.run(
        [sys.executable, str(root / "tools" / "gen_proto.py")], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert _snapshot(root) == before
    assert sorted(p.name for p in (root / "clients/python/hicached_client").iterdir()) == ["v1"]


def test_a_failed_generation_leaves_the_checked_in_code(tmp_path: Path) -> None:
    """Without the generator (an install without the dev tools), or with a proto protoc refuses,
    gen_proto.py fails with a hint and changes nothing. It deleted the package first before."""
    root = _copy_of_the_tree(tmp_path)
    before = _snapshot(root)
    no_tools = tmp_path / "no_tools" / "grpc_tools"
    no_tools.mkdir(parents=True)
    (no_tools / "__init__.py").write_text("raise ImportError('grpcio-tools is not installed here')\n")
    missing = subprocess.run(
        [sys.executable, str(root / "tools" / "gen_proto.py")],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(no_tools.parent)},
    )
    assert missing.returncode != 0
    assert "grpcio-tools is missing" in missing.stderr
    assert _snapshot(root) == before
    bad = root / "proto/hicached/v1/hicached.proto"
    bad.write_text(bad.read_text() + "\nmessage {\n")
    broken = subprocess.run(
        [sys.executable, str(root / "tools" / "gen_proto.py")], capture_output=True, text=True, check=False
    )
    assert broken.returncode != 0
    assert _snapshot(root) == before
