"""A socket the daemon cannot remove at stop is named in its log, for each of its listeners.

The daemon runs as nobody (so the directory's permissions bind it) and its socket directory is
made read-only before SIGTERM: every unlink fails with EACCES. Fails before: the fast lane and
the fd handoff ignored the failure without a word, and the gRPC listeners' unlink raised out of
their shutdown step (the admin socket was not tried; "shutdown steps failed: grpc", exit 1).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.security.users import NOBODY, as_nobody
from tests.support.faults import log_lines, serve_patched, socket_files


def test_a_socket_left_behind_at_stop_is_logged_and_the_rest_of_the_stop_goes_on() -> None:
    d = serve_patched("", runner=as_nobody(), owner=NOBODY)
    workdir = d.workdir
    try:
        sockets = socket_files(workdir)
        assert {"d.sock", "d.sock.lane", "d.sock.fds"} <= set(sockets), sockets
        os.chmod(workdir, 0o500)
        try:
            code = d.terminate()
        finally:
            os.chmod(workdir, 0o700)
        assert code == 0, d.log[-3000:]
        assert socket_files(workdir) == sockets, "nothing could be removed"
        for name in sockets:
            lines = log_lines(d, f"cannot remove the socket {Path(workdir, name)}: ")
            assert lines and "Permission denied" in lines[0], (name, d.log[-3000:])
    finally:
        d.stop()
