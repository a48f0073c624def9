"""A worker that outlives a daemon restart: it re-attaches and finds its prefix in L3.

It starts its own daemon (file L3 in a temporary directory), publishes a prefix
(written through to L3 in the background), restarts the daemon (SIGTERM flushes
pending L3 writes; the new daemon has the same socket and L3 directory). The
worker's next call says the daemon no longer knows its session (NOT_FOUND): it
attaches again with a higher generation, finds the prefix in L3 and loads it
back byte for byte. Then it stops the daemon and removes its files.

    python examples/reattach_after_restart.py
"""

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import torch
from hicached_client import HiCacheClient, HiCacheError, TokenChain, Transfer, WorkerIdentity, pool_spec
from hicached_client.export import ShmKVPool

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 64, 16
PREFIX = TokenChain(list(range(500, 500 + 4 * PAGE)))


def start_daemon(workdir: Path) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "hicached", "serve",
        "--socket", str(workdir / "hicached.sock"),
        "--host-budget", "64MiB",
        "--l3", "file",
        "--l3-path", str(workdir / "l3"),
        "--set", f"host.shm_prefix=hicached-example-{os.getpid()}",
        "--set", "server.grace_s=2",  # in-flight RPCs' time to finish on SIGTERM
        "--log-level", "warning",
    ]  # fmt: skip
    return subprocess.Popen(args, cwd=workdir)


def stop_daemon(daemon: subprocess.Popen) -> None:
    daemon.send_signal(signal.SIGTERM)  # flushes pending L3 writes, then exits 0
    code = daemon.wait(timeout=60)
    assert code == 0, f"daemon exited with {code}"


def attach(client: HiCacheClient, kv: ShmKVPool, generation: int):
    spec = pool_spec(
        "kv",
        role="anchor",
        kind="mha",
        dtype="bfloat16",
        page_size=PAGE,
        num_layers=LAYERS,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        k_buffers=kv.k_buffers(),
        v_buffers=kv.v_buffers(),
    )
    identity = WorkerIdentity("example-restart-worker", generation, "example-model-restart")
    return client.attach(identity, [spec])


def main() -> None:
    with (
        tempfile.TemporaryDirectory(prefix="hicached-example-") as tmp,
        ShmKVPool(
            f"hicached-example-{os.getpid()}-kv",
            num_layers=LAYERS,
            tokens=64 * PAGE,
            heads=HEADS,
            head_dim=HEAD_DIM,
            dtype=torch.bfloat16,
        ) as kv,
    ):
        workdir = Path(tmp)
        for t in (*kv.k, *kv.v):
            t.normal_()
        daemon = start_daemon(workdir)
        try:
            with HiCacheClient(f"unix://{workdir / 'hicached.sock'}") as client:
                client.wait_ready(60)
                generation = 1
                session = attach(client, kv, generation)
                written = session.write([Transfer("kv", [0, 1, 2, 3])], allocate=True)
                assert written.ok and session.publish(PREFIX, written.transfers).published_pages == 4
                print("verified: published a 4-page prefix (written through to the file L3)")

                # A real worker keeps heartbeating through a restart (failures are logged and
                # retried); stopped here only to keep this example's output short.
                session.stop_heartbeat()
                stop_daemon(daemon)
                daemon = start_daemon(workdir)
                client.wait_ready(60)
                print("restarted the daemon")

                try:
                    session.lookup(PREFIX)
                    raise AssertionError("the new daemon knows the old session")
                except HiCacheError as exc:
                    assert exc.code == grpc.StatusCode.NOT_FOUND, exc
                session.close()  # stops its heartbeat; the daemon already forgot it
                generation += 1
                session = attach(client, kv, generation)
                print(
                    f"verified: the old session is gone (NOT_FOUND); re-attached as generation {generation}"
                )

                found = session.lookup(PREFIX)
                assert found.total_hit_pages == 4, found
                got = session.get_pages(PREFIX, [Transfer("kv", [20, 21, 22, 23])], include_l3=True)
                assert got.hit_pages == 4, got
                for t in (*kv.k, *kv.v):
                    assert torch.equal(t[20 * PAGE : 24 * PAGE], t[0 : 4 * PAGE])
                print(f"verified: the prefix survived the restart ({found.l2_hit_pages} of 4 pages in L2, "
                      "the rest in L3) and loaded back byte for byte")  # fmt: skip
                session.detach()
        finally:
            if daemon.poll() is None:
                stop_daemon(daemon)


if __name__ == "__main__":
    main()
