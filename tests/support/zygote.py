"""Worker processes forked from one that has already imported their modules.

A transformers worker spends ~6 s of its life importing torch and transformers before it
computes anything; a test that runs a dozen of them waits a minute for imports alone. A
:class:`Zygote` is one process that imports those modules once and then forks a worker per
:meth:`Zygote.run`: each worker is still a process of its own (its own pid, gRPC channels,
memory and exit status), run as ``python -m MODULE ARGS`` would run it, with its stdout and
stderr captured.

The zygote itself computes nothing and starts no thread before it forks (checked), so the
children inherit no lock held by a thread that does not exist in them.

Thread-safety: one :class:`Zygote` serves one caller at a time (a test's own thread).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.daemon import ROOT


class Zygote:
    """A process that has imported ``preload`` and forks workers on request."""

    def __init__(self, preload: Sequence[str], *, start_timeout_s: float = 120.0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", *preload],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reply(start_timeout_s, expect="ready")

    def run(self, module: str, argv: Sequence[str], *, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Run ``python -m module *argv`` as a forked child; killed (SIGKILL) past ``timeout_s``."""
        assert self._proc.stdin is not None
        with tempfile.TemporaryDirectory(prefix="zygote-") as scratch:
            out, err = Path(scratch) / "out", Path(scratch) / "err"
            out.touch()
            err.touch()
            request = {"module": module, "argv": list(argv), "out": str(out), "err": str(err)}
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            pid = int(self._reply(30.0, expect="pid"))
            try:
                code = int(self._reply(timeout_s, expect="rc"))
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._reply(30.0, expect="rc")
                raise
            return subprocess.CompletedProcess(
                [module, *argv], code, out.read_text(errors="replace"), err.read_text(errors="replace")
            )

    def _reply(self, timeout_s: float, *, expect: str) -> str:
        """The value of the zygote's next line ``{expect: value}``; TimeoutError past ``timeout_s``."""
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"the zygote wrote no {expect!r} within {timeout_s} s")
        line = self._proc.stdout.readline()
        if not line:
            err = self._proc.stderr.read() if self._proc.stderr is not None else ""
            raise RuntimeError(f"the zygote exited ({self._proc.wait()}):\n{err[-4000:]}")
        return str(json.loads(line)[expect])

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()  # the zygote's loop ends at end of input
        self._proc.wait(timeout=30)
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()


def _child(request: dict[str, Any]) -> None:
    """In the forked child: run the module as ``__main__`` with its output redirected; never returns."""
    code = 1
    try:
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                                (2, request["err"], os.O_WRONLY)):  # fmt: skip
            new = os.open(str(path), flags)
            os.dup2(new, fd)
            os.close(new)
        sys.argv = [str(request["module"]), *(str(a) for a in request["argv"])]
        try:
            runpy.run_module(str(request["module"]), run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(preload: Sequence[str]) -> int:
    for name in preload:
        importlib.import_module(name)
    # A thread of this process would not exist in a child, and any lock it held would stay held.
    assert threading.active_count() == 1, f"the zygote started threads: {threading.enumerate()}"
    print(json.dumps({"ready": time.monotonic()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
