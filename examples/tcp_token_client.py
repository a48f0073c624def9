"""A byte-only client over TCP with a bearer token (e.g. a worker on another host).

It starts its own daemon (a Unix socket plus a TCP listener on loopback that
requires a token), attaches a pool without device buffers, stores pages as bytes
(PutBytes), reads them back (GetBytes) and checks them; a call without the token
is refused. It then stops the daemon (SIGTERM) and removes its files.

    python examples/tcp_token_client.py
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
from hicached_client import HiCacheClient, HiCacheError, PageBytes, WorkerIdentity, pool_spec

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 64, 16
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2  # K and V of every layer, bfloat16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(workdir: Path, token_file: Path, port: int) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "hicached", "serve",
        "--socket", str(workdir / "hicached.sock"),
        "--listen", f"127.0.0.1:{port}",
        "--set", f"server.auth_token_file={token_file}",
        "--host-budget", "64MiB",
        "--l3", "none",
        "--set", f"host.shm_prefix=hicached-example-{os.getpid()}",
        "--log-level", "warning",
    ]  # fmt: skip
    return subprocess.Popen(args, cwd=workdir)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hicached-example-") as tmp:
        workdir = Path(tmp)
        token = secrets.token_urlsafe(24)
        token_file = workdir / "token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        port = free_port()
        daemon = start_daemon(workdir, token_file, port)
        try:
            with HiCacheClient(f"127.0.0.1:{port}", token=token) as client:
                client.wait_ready(60)
                spec = pool_spec(
                    "kv",
                    role="anchor",
                    kind="mha",
                    dtype="bfloat16",
                    page_size=PAGE,
                    num_layers=LAYERS,
                    num_heads=HEADS,
                    head_dim=HEAD_DIM,
                    k_buffers=(),  # byte-only: no device buffers to share with the daemon
                    host_bytes=64 * PAGE_BYTES,
                )
                identity = WorkerIdentity("example-remote-client", 1, "example-model-remote")
                with client.attach(identity, [spec]) as session:
                    pages = {secrets.token_hex(32): os.urandom(PAGE_BYTES) for _ in range(3)}
                    stored = session.put_bytes([PageBytes(k, "kv", v) for k, v in pages.items()])
                    assert stored.stored_pages == 3, stored
                    got = session.get_bytes(list(pages))
                    assert got.hit_pages == 3 and [p.data for p in got.pages] == list(pages.values())
                    print(
                        f"verified: 3 pages of {PAGE_BYTES} bytes stored and read back over TCP with a token"
                    )
            with HiCacheClient(f"127.0.0.1:{port}") as anonymous:
                try:
                    anonymous.get_stats()
                    raise AssertionError("the daemon answered a call without the token")
                except HiCacheError as exc:
                    assert exc.code == grpc.StatusCode.UNAUTHENTICATED, exc
            print("verified: a call without the token is refused (UNAUTHENTICATED)")
        finally:
            daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(timeout=60)
        assert code == 0, f"daemon exited with {code}"
        print("verified: the daemon stopped cleanly on SIGTERM")


if __name__ == "__main__":
    main()
