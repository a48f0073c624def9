"""Issue 11 items 1 and 5: every L3 backend starts from ``hicached serve`` and a TOML file alone
against its real server on loopback, and survives a daemon restart with its pages readable;
a backend that cannot start is one line naming the key to fix, exit status 2.

Before the per-backend tables, ``hicached serve --l3 redis`` could not start at all (the
daemon passed a ``url`` option ``RedisBackendConfig`` does not have) and S3 credentials,
prefix and Mooncake options could not be set from the configuration: the redis, s3 and
mooncake cases fail on that code, and every "cannot start" case printed a traceback.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hicached_client import HiCacheClient, TokenChain, WorkerIdentity

from hicached.testing.servers import free_ports, mooncake_master, redis_server, seaweedfs
from tests.acceptance.cfg_serve import Served, hicached, serve
from tests.support.kv import PAGE_SIZE, POOLS, WorkerPools, transfers, unique_tag

PAGES = 16
MODEL = "acceptance-l3"
BASE = """
[host]
budget = "256MiB"
[server]
max_batch_pages = 512
[sessions]
lease_ms = 2000
"""


@contextlib.contextmanager
def backend_config(name: str, tmp_path: Path) -> Iterator[str]:
    """The ``[l3]`` part of a TOML file for backend ``name``, its server running meanwhile."""
    unique = uuid.uuid4().hex[:8]
    if name == "file":
        yield f'[l3]\nbackend = "file"\n[l3.file]\npath = "{tmp_path / "l3"}"\ncapacity_bytes = "256MiB"\n'
    elif name == "redis":
        with redis_server() as r:
            yield (
                f'[l3]\nbackend = "redis"\n[l3.redis]\nhost = "{r.host}"\nport = {r.port}\n'
                f'key_prefix = "acc-{unique}/"\n'
            )
    elif name == "s3":
        with seaweedfs() as s3:
            yield (
                f'[l3]\nbackend = "s3"\n[l3.s3]\nendpoint_url = "{s3.endpoint_url}"\nbucket = "{s3.bucket}"\n'
                f'prefix = "acc-{unique}/"\naccess_key_id = "{s3.access_key_id}"\n'
                f'secret_access_key = "{s3.secret_access_key}"\n'
            )
    else:
        with mooncake_master() as m:
            yield (
                f'[l3]\nbackend = "mooncake"\n[l3.mooncake]\nmaster_addr = "{m.master_addr}"\n'
                f'key_prefix = "acc-{unique}/"\n'
            )


@pytest.fixture
def pools() -> Iterator[list[WorkerPools]]:
    made: list[WorkerPools] = []
    yield made
    for p in made:
        p.close()


def _pools(made: list[WorkerPools], seed: int | None) -> tuple[str, WorkerPools]:
    tag = unique_tag("acc")
    p = WorkerPools.create(tag)
    made.append(p)
    if seed is None:
        p.clobber()
    else:
        p.fill_random(seed)
    return tag, p


def _chain() -> TokenChain:
    return TokenChain([7 + i for i in range(PAGES * PAGE_SIZE)], cache_salt=uuid.uuid4().hex)


@pytest.mark.parametrize("backend", ["file", "redis", "s3", "mooncake"])
def test_backend_from_toml_survives_a_restart(backend: str, tmp_path: Path, pools: list[WorkerPools]) -> None:
    tokens = _chain()
    tag_a, pools_a = _pools(pools, seed=11)
    with backend_config(backend, tmp_path) as l3:
        first = serve(tmp_path, BASE + l3)
        try:
            assert f"l3={backend}" in first.log, first.log  # the banner names the backend
            with HiCacheClient(first.target, timeout_s=60.0) as client:
                ident = WorkerIdentity(tag_a, generation=1, model_name=MODEL)
                with client.attach(ident, pools_a.specs()) as a:
                    assert a.put_pages(tokens, transfers(range(PAGES))).stored_pages == PAGES
                    backed = a.backup(tokens, wait=True)
                    assert backed.stored_pages == backed.queued_pages
        finally:
            rc = first.stop()
            first.cleanup()
        assert rc == 0, first.log

        tag_b, pools_b = _pools(pools, seed=None)
        second: Served = serve(tmp_path, BASE + l3)
        try:
            with HiCacheClient(second.target, timeout_s=60.0) as client:
                ident = WorkerIdentity(tag_b, generation=1, model_name=MODEL)
                with client.attach(ident, pools_b.specs()) as b:
                    seen = b.lookup(tokens)
                    assert (seen.l2_hit_pages, seen.total_hit_pages) == (0, PAGES), "only L3 holds them"
                    dst = list(range(300, 300 + PAGES))
                    got = b.get_pages(tokens, transfers(dst), include_l3=True)
                    assert got.hit_pages == PAGES
                    for pool in POOLS:
                        assert pools_b.digest(pool, dst) == pools_a.digest(pool, range(PAGES)), pool
        finally:
            assert second.stop() == 0, second.log
            second.cleanup()


def _cannot_start(tmp_path: Path, config_text: str, *extra: str, python: list[str] | None = None) -> str:
    """Run ``serve`` expecting it to refuse; returns its single output line."""
    sockdir = tmp_path / "s"
    sockdir.mkdir(exist_ok=True)
    flags = ["--socket", str(sockdir / "d.sock"), "--set", f"host.shm_prefix=hcx{uuid.uuid4().hex[:8]}"]
    if python is None:
        (tmp_path / "hicached.toml").write_text(config_text)
        result = hicached("serve", "--config", "hicached.toml", *flags, *extra, cwd=tmp_path, timeout=120)
    else:
        import subprocess

        from tests.acceptance.cfg_serve import clean_env

        (tmp_path / "hicached.toml").write_text(config_text)
        result = subprocess.run(
            [*python, "serve", "--config", "hicached.toml", *flags, *extra],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    lines = output.splitlines()
    assert len(lines) == 1, output
    assert not (sockdir / "d.sock").exists(), "nothing was served"
    return lines[0]


def test_unreachable_redis_is_one_line_naming_the_keys(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    line = _cannot_start(tmp_path, BASE + f'[l3]\nbackend = "redis"\n[l3.redis]\nport = {port}\n')
    assert f"127.0.0.1:{port}" in line and "l3.redis.host" in line and "l3.redis.port" in line, line


def test_a_redis_that_refuses_the_login_is_one_line_naming_the_password(tmp_path: Path) -> None:
    """Fails before: a server that asks a password (none given, or a wrong one) was reported as
    "unreachable", and the line named only the host and port to fix."""
    import redis

    with redis_server() as r:
        redis.Redis(host=r.host, port=r.port).config_set("requirepass", "sekret")
        table = BASE + f'[l3]\nbackend = "redis"\n[l3.redis]\nhost = "{r.host}"\nport = {r.port}\n'
        for given in ("", 'password = "wrong"\n'):
            line = _cannot_start(tmp_path, table + given)
            assert "refused the login" in line and "l3.redis.password" in line, line
            assert "unreachable" not in line and "<L3Backend" not in line and "[[" not in line, line


def test_unreachable_s3_and_mooncake_name_their_keys(tmp_path: Path) -> None:
    s3_port, mc_port = free_ports(2)
    line = _cannot_start(
        tmp_path,
        BASE + f'[l3]\nbackend = "s3"\n[l3.s3]\nendpoint_url = "http://127.0.0.1:{s3_port}"\n'
        'max_attempts = 1\nconnect_timeout_s = 1.0\naccess_key_id = "k"\nsecret_access_key = "s"\n',
    )
    assert "l3.s3.endpoint_url" in line, line
    line = _cannot_start(
        tmp_path, BASE + f'[l3]\nbackend = "mooncake"\n[l3.mooncake]\nmaster_addr = "127.0.0.1:{mc_port}"\n'
    )
    assert "l3.mooncake.master_addr" in line and str(mc_port) in line, line


def test_unwritable_file_path_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    line = _cannot_start(tmp_path, BASE, "--l3", "file", "--l3-path", str(blocker / "l3"))
    assert "l3.file.path" in line and str(blocker) in line, line


def test_file_directory_in_use_is_one_line(tmp_path: Path) -> None:
    l3 = tmp_path / "shared-l3"
    config = BASE + f'[l3]\nbackend = "file"\n[l3.file]\npath = "{l3}"\n'
    first_dir = tmp_path / "first"
    first_dir.mkdir()
    first = serve(first_dir, config)
    try:
        second_dir = tmp_path / "second"
        second_dir.mkdir()
        line = _cannot_start(second_dir, config)
        assert "in use" in line and "l3.file.path" in line and str(l3) in line, line
    finally:
        first.cleanup()


def test_missing_client_package_is_one_line_with_the_install_hint(tmp_path: Path) -> None:
    """The redis package made unimportable the standard way (``sys.modules[name] = None``)."""
    python = [
        sys.executable,
        "-c",
        "import sys; sys.modules['redis'] = None; from hicached.cli import main; sys.exit(main())",
    ]
    line = _cannot_start(tmp_path, BASE + '[l3]\nbackend = "redis"\n', python=python)
    assert "pip install" in line and "redis" in line, line


def test_env_and_set_forms_reach_the_backend(tmp_path: Path) -> None:
    """``HICACHED_L3_REDIS_PORT`` and ``--set l3.redis.host=...`` configure the same backend
    as the ``[l3.redis]`` table: the file points at a dead port, the environment fixes it."""
    with redis_server() as r:
        (dead,) = free_ports(1)
        config = BASE + f'[l3]\nbackend = "redis"\n[l3.redis]\nhost = "192.0.2.1"\nport = {dead}\n'
        served = serve(tmp_path, config, "--set", f"l3.redis.host={r.host}",
                       env={"HICACHED_L3_REDIS_PORT": str(r.port)})  # fmt: skip
        try:
            assert f"l3_target={r.host}:{r.port}/0" in served.log, served.log
        finally:
            assert served.stop() == 0, served.log
            served.cleanup()
