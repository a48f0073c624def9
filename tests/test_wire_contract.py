"""The wire contract: generated code is current, the proto lints, no pickle."""

from __future__ import annotations

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
