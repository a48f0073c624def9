"""The first requests after a start pay no lazy import on their path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The core in a fresh process, through tests/core's harness: a session's first Write, Load,
# PutPages, Lookup, GetPages and Free, with a repeated page refused on the way.
_SCRIPT = """
import sys
import numpy as np
import tests.core.conftest as harness
from hicached.errors import InvalidArgument
from hicached.l2.group_types import PoolTransfer

pages = lambda *v: np.asarray(v, dtype=np.int64)
factory = harness.make_core.__wrapped__()
c = next(factory)()
sid = c.attach()
w = c.core.write(sid, "w1", [PoolTransfer("kv", pages(0, 1), None)], allocate=True)
host = w.transfers[0].host_indices
c.core.load(sid, "l1", [PoolTransfer("kv", pages(2, 3), host)])
try:
    c.core.load(sid, "l2", [PoolTransfer("kv", pages(4, 4), host)])
    raise SystemExit("a repeated device page was accepted")
except InvalidArgument as exc:
    assert "duplicate" in str(exc), exc
both = lambda *v: [PoolTransfer("kv", pages(*v), None), PoolTransfer("swa", pages(*v), None)]
c.keyed.put_pages(sid, "p1", ["a", "b"], both(5, 6))
assert c.keyed.lookup(sid, ["a", "b"]).l2_hit_pages == 2
hit, _ = c.keyed.get_pages(sid, "g1", ["a", "b"], both(7, 8), include_l3=False)
assert hit == 2
c.core.free(sid, "f1", "kv", host)
loaded = "numpy.ma" in sys.modules
next(factory, None)  # the harness's teardown: closes the core, unlinks the segments
print(loaded)
"""


def test_the_first_requests_do_not_import_numpy_ma() -> None:
    """Fails before first_repeat/distinct: the first request's page checks called np.unique,
    whose first call in a process imports numpy.ma (7-12 ms of the first GetPages after a
    daemon start, measured in the sglang bench's cold get)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout
