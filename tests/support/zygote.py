"""Worker processes forked from one that has already imported their modules.

A transformers worker spends ~6 s of its life importing torch and transformers before it
computes anything, an SGLang rank ~10 s; a test that runs a dozen of them waits a minute for
imports alone. A :class:`Zygote` is one process that imports those modules once and then
forks a worker per :meth:`Zygote.start`: each worker is still a process of its own (its own
pid, gRPC channels, memory and exit status), run as ``python -m MODULE ARGS`` would run it,
with its stdout and stderr captured; several may run at once.

The zygote itself computes nothing and starts no thread before it forks (checked), so the
children inherit no lock held by a thread that does not exist in them.

Thread-safety: one :class:`Zygote` (and its :class:`Forked` workers) serves one caller
thread at a time.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.daemon import ROOT


class Forked:
    """One worker the zygote forked; :meth:`wait` for its exit and output."""

    def __init__(
        self, zygote: Zygote, pid: int, args: list[str], scratch: tempfile.TemporaryDirectory[str]
    ) -> None:
        self.pid = pid
        self._zygote = zygote
        self._args = args
        self._scratch = scratch

    def wait(self, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Its exit status and output; past ``timeout_s`` it is killed (SIGKILL) and TimeoutError raised."""
        try:
            try:
                code = self._zygote._exit_of(self.pid, timeout_s)
            except TimeoutError:
                os.kill(self.pid, signal.SIGKILL)
                self._zygote._exit_of(self.pid, 30.0)
                raise
            out, err = (Path(self._scratch.name) / name for name in ("out", "err"))
            return subprocess.CompletedProcess(
                self._args, code, out.read_text(errors="replace"), err.read_text(errors="replace")
            )
        finally:
            self._scratch.cleanup()


class Zygote:
    """A process that has imported ``preload`` and forks workers on request."""

    def __init__(
        self, preload: Sequence[str], *, env: Mapping[str, str] | None = None, start_timeout_s: float = 120.0
    ) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", *preload],
            cwd=ROOT,
            env=None if env is None else dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its workers share its process group: close() can end them all
        )
        self._buffer = b""
        self._exited: dict[int, int] = {}
        self._next(start_timeout_s, "ready")

    def start(self, module: str, argv: Sequence[str]) -> Forked:
        """Fork a worker that runs ``python -m module *argv``; it runs until it exits."""
        assert self._proc.stdin is not None
        scratch = tempfile.TemporaryDirectory(prefix="zygote-")
        for name in ("out", "err"):
            (Path(scratch.name) / name).touch()
        request = {"module": module, "argv": list(argv), "dir": scratch.name}
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        pid = int(self._next(30.0, "forked")["forked"])
        return Forked(self, pid, [module, *argv], scratch)

    def run(self, module: str, argv: Sequence[str], *, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """:meth:`start` and :meth:`Forked.wait`."""
        return self.start(module, argv).wait(timeout_s)

    def _exit_of(self, pid: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while pid not in self._exited:
            self._next(max(0.0, deadline - time.monotonic()), "exited")
        return self._exited.pop(pid)

    def _next(self, timeout_s: float, kind: str) -> dict[str, Any]:
        """The zygote's next message of ``kind`` (exits read on the way are kept); TimeoutError
        past ``timeout_s``."""
        assert self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                message: dict[str, Any] = json.loads(line)
                if "exited" in message:
                    self._exited[int(message["exited"])] = int(message["rc"])
                if kind in message:
                    return message
            fd = self._proc.stdout.fileno()
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"the zygote wrote no {kind!r} within {timeout_s} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                err = self._proc.stderr.read() if self._proc.stderr is not None else b""
                raise RuntimeError(
                    f"the zygote exited ({self._proc.wait()}):\n{err[-4000:].decode(errors='replace')}"
                )
            self._buffer += chunk

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()  # the zygote ends at end of input, once its workers have
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a worker hangs: end it and the zygote
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()


def _child(request: dict[str, Any]) -> None:
    """In the forked child: run the module as ``__main__`` with its output redirected; never returns."""
    code = 1
    try:
        scratch = Path(request["dir"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, scratch / "out", os.O_WRONLY),
                                (2, scratch / "err", os.O_WRONLY)):  # fmt: skip
            new = os.open(path, flags)
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


def _say(message: dict[str, object]) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def main(preload: Sequence[str]) -> int:
    for name in preload:
        importlib.import_module(name)
    # A thread of this process would not exist in a child, and any lock it held would stay held.
    assert threading.active_count() == 1, f"the zygote started threads: {threading.enumerate()}"
    _say({"ready": True})
    children: dict[int, int] = {}  # pidfd -> pid
    pending, open_input = b"", True
    while open_input or children:
        ready, _, _ = select.select([0, *children] if open_input else list(children), [], [])
        for fd in ready:
            if fd != 0:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _say({"exited": pid, "rc": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(0, 65536)
            open_input = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    for pidfd in children:
                        os.close(pidfd)
                    _child(json.loads(line))
                children[os.pidfd_open(pid)] = pid
                _say({"forked": pid})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
