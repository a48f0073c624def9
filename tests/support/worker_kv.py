"""A worker process for the integration tests: ``python -m tests.support.worker_kv SCENARIO ...``.

Each scenario creates its own shm "device" pools, attaches to the daemon with
the client library, does its work and prints JSON lines on stdout (the last
one is its report); the test process asserts on the reports. Scenarios live in
a registry; each one cleans up its segments, except when it is killed (then
the test does).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from typing import Any

from hicached_client import HiCacheClient, Session, WorkerIdentity

from tests.support.kv import DEVICE_PAGES, POOLS, WorkerPools, host_pages_of, transfers

Report = dict[str, Any]
SCENARIOS: dict[str, Callable[[argparse.Namespace, HiCacheClient, WorkerPools], Report]] = {}


def scenario(fn: Callable[[argparse.Namespace, HiCacheClient, WorkerPools], Report]) -> Any:
    SCENARIOS[fn.__name__] = fn
    return fn


def emit(report: Report) -> None:
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


def group_free(session: Session, group: str) -> dict[str, int]:
    """Free pages of each pool of ``group``, from the session's own view (a worker's GetStats
    shows no pool group unless it names its session)."""
    for g in session.stats().groups:
        if g.group == group:
            return {p.name: p.free_pages for p in g.pools}
    raise AssertionError(f"group {group!r} not in GetStats")


def group_of(session: Session) -> str:
    info = session.stats().session(session.session_id)
    assert info is not None, f"session {session.session_id} missing from its own stats"
    return info.group


def slots(seed: int, n: int) -> tuple[list[int], list[int]]:
    """``n`` source and ``n`` different destination device pages, shuffled."""
    rng = random.Random(seed)
    src = rng.sample(range(DEVICE_PAGES), n)
    dst = rng.sample(sorted(set(range(DEVICE_PAGES)) - set(src)), n)
    return src, dst


def identity(args: argparse.Namespace) -> WorkerIdentity:
    return WorkerIdentity(args.tag, generation=1, model_name=args.model)


@scenario
def roundtrip(args: argparse.Namespace, client: HiCacheClient, pools: WorkerPools) -> Report:
    """Write N random pages of both pools, clobber the device, load them into other slots."""
    with client.attach(identity(args), pools.specs()) as session:
        group = group_of(session)
        free_before = group_free(session, group)
        src, dst = slots(args.seed, args.pages)
        pools.fill_random(args.seed)
        expected = {p: pools.digest(p, src) for p in POOLS}
        written = session.write(transfers(src), allocate=True)
        host = host_pages_of(written.transfers)
        free_written = group_free(session, group)
        pools.clobber()
        loaded = session.load(transfers(dst, host)).wait()
        report = {
            "ok": written.ok,
            "expected": expected,
            "actual": {p: pools.digest(p, dst) for p in POOLS},
            "untouched": {p: pools.untouched(p, dst) for p in POOLS},
            "layers": list(loaded.layers),
            "write_acks": {a.pool: [a.pages, a.tokens, a.bytes] for a in written.acks},
            "load_acks": {a.pool: [a.pages, a.tokens, a.bytes] for a in loaded.acks},
            "host_allocated": {t.pool: t.host_allocated for t in written.transfers},
            "free_before": free_before,
            "free_written": free_written,
            "released": session.release_transfers(written.transfers),
            "free_after": group_free(session, group),
        }
    return report


@scenario
def retract(args: argparse.Namespace, client: HiCacheClient, pools: WorkerPools) -> Report:
    """Retraction backup -> clobber -> restore into new slots; host availability round trip."""
    with client.attach(identity(args), pools.specs()) as session:
        group = group_of(session)
        free_before = group_free(session, group)
        src, dst = slots(args.seed, args.pages)
        pools.fill_random(args.seed)
        expected = {p: pools.digest(p, src) for p in POOLS}
        num_tokens = args.pages * 4 - 3  # the last page is partial
        backup = session.retract_backup("req-1", transfers(src), num_tokens)
        stats = session.stats()
        listed = [b.pages for b in stats.backups if b.backup_id == backup.backup_id]
        free_backed_up = group_free(session, group)
        pools.clobber()
        restored = session.retract_restore_wait(backup.backup_id, transfers(dst))
        return {
            "ok": backup.ok,
            "listed": listed,
            "expected": expected,
            "actual": {p: pools.digest(p, dst) for p in POOLS},
            "untouched": {p: pools.untouched(p, dst) for p in POOLS},
            "layers": list(restored.layers),
            "free_before": free_before,
            "free_backed_up": free_backed_up,
            "free_after": group_free(session, group),
            "backups_after": [b.backup_id for b in session.stats().backups],
            "backup_id": backup.backup_id,
        }


@scenario
def decline(args: argparse.Namespace, client: HiCacheClient, pools: WorkerPools) -> Report:
    """Fill the host pool but a few pages; a bigger backup / allocating write is declined."""
    with client.attach(identity(args), pools.specs()) as session:
        group = group_of(session)
        total = group_free(session, group)
        held: list[int] = []
        while (want := total["kv"] - args.room - len(held)) > 0:  # Alloc is capped at max_batch_pages
            got = session.alloc("kv", min(want, 256))
            assert got.ok, f"alloc of {min(want, 256)} pages failed with {total['kv'] - len(held)} free"
            held += got.host_pages
        free_held = group_free(session, group)
        src, _ = slots(args.seed, args.pages)
        backup = session.retract_backup("req-big", transfers(src), args.pages * 4)
        free_after_backup = group_free(session, group)
        write = session.write(transfers(src), allocate=True)
        free_after_write = group_free(session, group)
        freed = sum(session.free("kv", held[i : i + 256]) for i in range(0, len(held), 256))
        return {
            "backup_ok": backup.ok,
            "backup_id": backup.backup_id,
            "write_ok": write.ok,
            "free_held": free_held,
            "free_after_backup": free_after_backup,
            "free_after_write": free_after_write,
            "backups": len(session.stats().backups),
            "freed": freed,
            "free_end": group_free(session, group),
            "total": total,
        }


@scenario
def hold_and_write(args: argparse.Namespace, client: HiCacheClient, pools: WorkerPools) -> Report:
    """Hold pages, then write in a loop until killed (the SIGKILL test)."""
    session = client.attach(identity(args), pools.specs())
    pools.fill_random(args.seed)
    held = session.alloc("kv", 64)
    src, _ = slots(args.seed, args.pages)
    first = session.write(transfers(src), allocate=True)
    emit({"session_id": session.session_id, "group": group_of(session), "held": held.ok, "first": first.ok})
    while True:  # until SIGKILL; each round leaves its pages allocated for a moment
        written = session.write(transfers(src), allocate=True)
        session.release_transfers(written.transfers)


@scenario
def owner(args: argparse.Namespace, client: HiCacheClient, pools: WorkerPools) -> Report:
    """Own pages and a backup, publish their ids, wait for a line on stdin, then verify them."""
    with client.attach(identity(args), pools.specs()) as session:
        src, dst = slots(args.seed, args.pages)
        pools.fill_random(args.seed)
        expected = {p: pools.digest(p, src) for p in POOLS}
        written = session.write(transfers(src), allocate=True)
        other_src, other_dst = dst[: args.pages // 2], dst[args.pages // 2 :]
        backup_expected = {p: pools.digest(p, other_src) for p in POOLS}
        backup = session.retract_backup("req-owner", transfers(other_src), len(other_src) * 4)
        emit({
            "session_id": session.session_id,
            "group": group_of(session),
            "host": host_pages_of(written.transfers),
            "backup_id": backup.backup_id,
            "device_pages": src,
        })  # fmt: skip
        sys.stdin.readline()
        pools.clobber()
        session.load(transfers(src, host_pages_of(written.transfers))).wait()
        session.retract_restore_wait(backup.backup_id, transfers(other_dst))
        return {
            "pages_intact": {p: pools.digest(p, src) == expected[p] for p in POOLS},
            "backup_intact": {p: pools.digest(p, other_dst) == backup_expected[p] for p in POOLS},
            "released": session.release_transfers(written.transfers),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--target", required=True)
    parser.add_argument("--tag", required=True, help="instance id and shm segment tag")
    parser.add_argument("--model", required=True)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--room", type=int, default=8, help="decline: host pages left free")
    args = parser.parse_args()
    pools = WorkerPools.create(args.tag)
    try:
        with HiCacheClient(args.target, timeout_s=60.0) as client:
            emit(SCENARIOS[args.scenario](args, client, pools))
    finally:
        pools.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
