"""Issue 5: configuration precedence per key, every validation error, ``config show``, ``serve``.

``resolve`` is called directly with explicit ``env`` dicts (never the test
process's environment) and a real TOML file in a temp dir; the CLI checks run
``python -m hicached`` as a subprocess with every ``HICACHED_*`` variable removed.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest

from hicached.coerce import type_hints
from hicached.config import ALIASES, Config, ConfigError, as_dict, describe, env_var, resolve, to_toml

ROOT = Path(__file__).resolve().parents[1]

# Keys whose valid values are constrained by another key: the three layers use values inside the bounds.
_SPECIAL: dict[str, tuple[Any, Any, Any]] = {
    "sessions.lease_ms": (1000, 2000, 3000),
    "sessions.min_lease_ms": (100, 200, 300),
    "sessions.max_lease_ms": (20_000, 30_000, 40_000),
    "server.metrics_port": (9001, 9002, 9003),
    "server.listen": ("127.0.0.1:7001", "[::1]:7002", "localhost:0"),
    "host.shm_prefix": ("hc-f", "hc_e", "hc.c"),
    "sessions.tenant_uids": ("a=1", "b=2,3", "c=4;d=5"),
    "server.socket_mode": (0o600, 0o640, 0o644),
    "l3.backend": ("none", "redis", "s3"),
    "l3.write_policy": ("write_back", "write_through_selective", "write_through"),
    "l3.prefetch_policy": ("timeout", "wait_complete", "best_effort"),
    "log.level": ("debug", "warning", "error"),
    "log.format": ("json", "text", "json"),
    "host.prefault": (False, True, False),
    "host.warm_restart": (True, False, True),
    "l3.redis.port": (7001, 7002, 7003),
    "l3.s3.endpoint_url": ("http://f:1", "http://e:2", "https://c:3"),
    "l3.s3.prefix": ("f/", "e/", "c/"),
    "l3.s3.addressing_style": ("path", "virtual", "path"),
    "l3.mooncake.master_addr": ("f:1", "e:2", "c:3"),
    "l3.mooncake.protocol": ("rdma", "tcp", "rdma"),
    "l3.file.fsync": (True, False, True),
    "l3.file.direct_io": (False, True, False),
    "l3.s3.create_bucket": (True, False, True),
    "l3.s3.conditional_put": (False, True, False),
    "server.insecure_tcp": (True, False, True),
    "server.fast_lane": (False, True, False),
}
# server.tls_cert and server.tls_key must be set together: each is layered with its partner in the file.
_PARTNER: dict[str, tuple[str, str]] = {
    "server.tls_cert": ("tls_key", '"/k.pem"'),
    "server.tls_key": ("tls_cert", '"/c.pem"'),
    # TCP fails closed: a listener is layered with insecure_tcp, mTLS with its certificate.
    "server.listen": ("insecure_tcp", "true"),
    "server.tls_client_ca": ("tls_cert", '"/c.pem"\ntls_key = "/k.pem"'),
    "l3.s3.access_key_id": ("s3.secret_access_key", '"secret"'),
    "l3.s3.secret_access_key": ("s3.access_key_id", '"key"'),
}


def _owner(key: str) -> tuple[Any, str]:
    """(the dataclass instance holding ``key`` in the defaults, the field name)."""
    *path, name = key.split(".")
    obj: Any = Config()
    for part in path:
        obj = getattr(obj, part)
    return obj, name


def _field(key: str) -> dataclasses.Field[Any]:
    obj, name = _owner(key)
    return next(f for f in dataclasses.fields(obj) if f.name == name)


def _kind(key: str) -> str:
    obj, name = _owner(key)
    return str(type_hints(type(obj))[name]).replace("<class '", "").replace("'>", "").split(".")[-1]


def _layer_values(key: str) -> tuple[Any, Any, Any]:
    """Three valid values (file, env, cli) for ``key``, each different from the layer below."""
    if key in _SPECIAL:
        return _SPECIAL[key]
    f = _field(key)
    if "parse" in f.metadata:
        return ("1MiB", "2MiB", "3MiB")
    kind = _kind(key)
    if kind in ("str | None", "typing.Optional[str]"):
        kind = "str"
    if kind == "int":
        return (7, 8, 9)
    if kind == "float":
        return (0.125, 0.25, 0.5)
    if kind == "Path":
        return ("/tmp/f.sock", "/tmp/e.sock", "/tmp/c.sock")
    if kind == "str":
        tail = key.replace(".", "-")
        return (f"/f/{tail}", f"/e/{tail}", f"/c/{tail}")
    raise AssertionError(f"no layer values for {key} of type {kind}: add it to _SPECIAL")


def _toml(value: Any, key: str = "") -> str:
    if key == "server.socket_mode":
        return f"0o{value:o}"  # modes are octal literals in TOML (a bare decimal is refused)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return f'"{value}"'


def _env_text(value: Any, key: str = "") -> str:
    if key == "server.socket_mode":
        return f"{value:o}"  # text modes are octal, as with chmod: "640"
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _get(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return str(value) if isinstance(value, Path) else value


def _expected(key: str, raw: Any) -> Any:
    f = _field(key)
    if "parse" in f.metadata:
        return f.metadata["parse"](raw)
    return raw


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / f"hicached-{uuid.uuid4().hex[:8]}.toml"
    path.write_text(text)
    return path


ALL_KEYS = [row[0] for row in describe()]


@pytest.mark.parametrize("key", ALL_KEYS)
def test_flag_beats_env_beats_file_beats_default(key: str, tmp_path: Path) -> None:
    """Every key, backend tables' options included (``[l3] redis.host = ...`` is the
    ``[l3.redis]`` table in TOML's dotted-key form)."""
    section, _, name = key.partition(".")
    file_value, env_value, cli_value = _layer_values(key)
    partner = _PARTNER.get(key)
    lines = [f"[{section}]", f"{name} = {_toml(file_value, key)}"]
    if partner is not None:
        lines.append(f"{partner[0]} = {partner[1]}")
    path = _write(tmp_path, "\n".join(lines) + "\n")
    env = {env_var(key): _env_text(env_value, key)}
    defaults = resolve(env={})
    assert _get(defaults, key) != _expected(key, file_value), "the file value must differ from the default"

    from_file = resolve(env={}, file=path)
    assert _get(from_file, key) == _expected(key, file_value)
    from_env = resolve(env=env, file=path)
    assert _get(from_env, key) == _expected(key, env_value)
    from_cli = resolve(cli={key: _env_text(cli_value, key)}, env=env, file=path)
    assert _get(from_cli, key) == _expected(key, cli_value)
    # Every other key keeps its default: a layer sets one key, not its whole section.
    layered = {key} | ({f"{section}.{partner[0]}"} if partner else set())
    if key.startswith("l3.") and key.count(".") == 2:  # the aliases of l3.file.* follow it
        layered |= {alias for alias, target in ALIASES.items() if target == key}
    if key == "server.tls_client_ca":
        layered.add("server.tls_key")  # the certificate's key comes with it
    others = [k for k in ALL_KEYS if k not in layered]
    assert {k: _get(from_cli, k) for k in others} == {k: _get(defaults, k) for k in others}


def test_config_file_from_hicached_config_env(tmp_path: Path) -> None:
    path = _write(tmp_path, "[copy]\nworkers = 5\n")
    assert resolve(env={"HICACHED_CONFIG": str(path)}).copy.workers == 5
    # An explicit file wins over $HICACHED_CONFIG.
    other = _write(tmp_path, "[copy]\nworkers = 6\n")
    assert resolve(env={"HICACHED_CONFIG": str(path)}, file=other).copy.workers == 6


def test_no_layer_gives_the_defaults() -> None:
    assert resolve(env={}) == Config()


def test_text_modes_are_octal_and_toml_modes_need_an_octal_literal(tmp_path: Path) -> None:
    for text in ("660", "0660", "0o660"):
        assert resolve(cli={"server.socket_mode": text}, env={}).server.socket_mode == 0o660
        assert resolve(env={"HICACHED_SERVER_SOCKET_MODE": text}).server.socket_mode == 0o660
    for literal in ("0o660", '"660"', "'0660'"):
        path = _write(tmp_path, f"[server]\nsocket_mode = {literal}\n")
        assert resolve(env={}, file=path).server.socket_mode == 0o660, literal


def test_backend_tables_build_the_backends_own_config(tmp_path: Path) -> None:
    from hicached.l3.redis import RedisBackendConfig
    from hicached.l3.s3 import S3BackendConfig

    path = _write(tmp_path, "[l3]\nbackend = 'redis'\n[l3.redis]\nhost = 'h'\nport = 7000\n")
    cfg = resolve(env={"HICACHED_L3_REDIS_DB": "3"}, cli={"l3.redis.password": "pw"}, file=path)
    assert cfg.l3.backend_config() == RedisBackendConfig(host="h", port=7000, db=3, password="pw")
    assert cfg.l3.s3 == S3BackendConfig(bucket="hicached"), "the other tables keep their defaults"
    assert resolve(cli={"l3.backend": "none"}, env={}).l3.backend_config() is None


# (source, key or section, bad value as it appears in the message, TOML text / env / cli setting)
BAD_FILE = {
    "unknown section": ("[nosuch]\nx = 1\n", ["nosuch"]),
    "section not a table": ('server = "x"\n', ["server"]),
    "unknown key": ("[server]\nsocket_path = '/x'\n", ["server.socket_path"]),
    "bad type int": ("[copy]\nworkers = 'many'\n", ["copy.workers", "'many'", "an integer"]),
    "bad type bool as int": ("[copy]\nworkers = true\n", ["copy.workers", "True", "an integer"]),
    "bad type bool": ("[host]\nprefault = 'maybe'\n", ["host.prefault", "'maybe'", "true or false"]),
    "bad type path": ("[server]\nsocket = 5\n", ["server.socket", "5", "a path"]),
    "bad type float": ("[server]\ngrace_s = 'soon'\n", ["server.grace_s", "'soon'", "a number"]),
    "bad choice": ("[l3]\nbackend = 'ftp'\n", ["l3.backend", "'ftp'", "file, redis, s3, mooncake, none"]),
    "bad choice log": ("[log]\nformat = 'xml'\n", ["log.format", "'xml'", "text, json"]),
    "non-positive int": ("[copy]\nworkers = 0\n", ["copy.workers", "0", "> 0"]),
    "non-positive size": ("[l3]\ncapacity = '0B'\n", ["[l3.file]", "'capacity_bytes'", ">= 512, got 0"]),
    "non-positive float": ("[host]\ndefault_ratio = -1.0\n", ["host.default_ratio", "-1.0", "> 0"]),
    "lease below min": ("[sessions]\nlease_ms = 100\n", ["sessions.lease_ms", "100", "500"]),
    "lease above max": (
        "[sessions]\nlease_ms = 400000\n",
        ["sessions.lease_ms", "400000", "300000"],
    ),
    "min above max": (
        "[sessions]\nmin_lease_ms = 5000\nmax_lease_ms = 4000\nlease_ms = 4500\n",
        ["sessions.lease_ms", "5000", "4000"],
    ),
    "budget fraction zero": ("[host]\nbudget_fraction = 0.0\n", ["host.budget_fraction", "0.0", "(0, 1]"]),
    "budget fraction above one": (
        "[host]\nbudget_fraction = 1.5\n",
        ["host.budget_fraction", "1.5", "(0, 1]"],
    ),
    "metrics port too big": ("[server]\nmetrics_port = 70000\n", ["server.metrics_port", "70000"]),
    "metrics port below -1": ("[server]\nmetrics_port = -2\n", ["server.metrics_port", "-2"]),
    "bad size string": ("[l3]\ncapacity = '12XB'\n", ["l3.file.capacity_bytes", "'12XB'", "512MiB"]),
    "negative size string": ("[host]\nbudget = '-1GiB'\n", ["host.budget", "'-1GiB'"]),
    "size of wrong type": ("[copy]\nmax_queued = 1.5\n", ["copy.max_queued", "1.5"]),
    "backend option of wrong type": (
        "[l3.redis]\nport = '6379'\n",
        ["l3.redis.port", "'6379'", "an integer"],
    ),
    "unknown backend option": ("[l3.redis]\nhots = 'h'\n", ["l3.redis.hots", "l3.redis.host"]),
    "backend option cross-check": ("[l3.redis]\nport = 70000\n", ["[l3.redis]", "'port'", "70000"]),
    "backend size option": (
        "[l3.mooncake]\nstaging_bytes = 'lots'\n",
        ["l3.mooncake.staging_bytes", "512MiB"],
    ),
    "removed loose key": ("[l3]\nurl = 'redis://h'\n", ["l3.url", "l3.redis.host", "l3.s3.endpoint_url"]),
    "decimal mode": ("[server]\nsocket_mode = 660\n", ["server.socket_mode", "0o660"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILE))
def test_invalid_file_value_names_key_and_value(case: str, tmp_path: Path) -> None:
    text, needles = BAD_FILE[case]
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        resolve(env={}, file=path)
    for needle in needles:
        assert needle in str(info.value), (case, needle, str(info.value))


# Values of the wrong TOML type that the documented contract ("an invalid value stops startup...
# there is no silent fallback") rejects: an int key given a fraction, a size given a negative
# count, a string key given a boolean.
SILENTLY_COERCED = {
    "float for int key": ("[copy]\nworkers = 2.5\n", ["copy.workers", "2.5"]),
    "float for octal mode": ("[server]\nsocket_mode = 1.5\n", ["server.socket_mode", "1.5"]),
    "negative byte count": ("[host]\nbudget = -5\n", ["host.budget", "-5"]),
    "bool for string key": ("[server]\nmetrics_host = true\n", ["server.metrics_host", "True"]),
    "number for tenant uids": ("[sessions]\ntenant_uids = 1000\n", ["sessions.tenant_uids", "1000"]),
    "number for a policy": ("[l3]\nwrite_policy = 1\n", ["l3.write_policy", "write_back"]),
    "integer past 4,300 digits": (
        "[limits]\nmax_wait_s = " + "9" * 5000 + "\n",
        ["not a configuration", "4300"],
    ),
}


@pytest.mark.parametrize("case", sorted(SILENTLY_COERCED))
def test_wrong_toml_type_is_rejected_not_coerced(case: str, tmp_path: Path) -> None:
    text, needles = SILENTLY_COERCED[case]
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        resolve(env={}, file=path)
    for needle in needles:
        assert needle in str(info.value), (case, needle, str(info.value))


BAD_ENV = {
    "HICACHED_COPY_WORKERS": ("2.5", ["copy.workers", "'2.5'", "an integer"]),
    "HICACHED_HOST_PREFAULT": ("perhaps", ["host.prefault", "'perhaps'"]),
    "HICACHED_L3_WRITE_POLICY": ("sometimes", ["l3.write_policy", "'sometimes'", "write_back"]),
    "HICACHED_SESSIONS_OP_CACHE_SIZE": ("-3", ["sessions.op_cache_size", "'-3'", "> 0"]),
    "HICACHED_SERVER_MAX_MESSAGE_BYTES": ("lots", ["server.max_message_bytes", "'lots'", "512MiB"]),
    "HICACHED_HOST_BUDGET_FRACTION": ("2", ["host.budget_fraction", "2.0", "(0, 1]"]),
    "HICACHED_SERVER_METRICS_PORT": ("65536", ["server.metrics_port", "65536"]),
}


@pytest.mark.parametrize("name", sorted(BAD_ENV))
def test_invalid_env_value_names_key_and_value(name: str) -> None:
    value, needles = BAD_ENV[name]
    with pytest.raises(ConfigError) as info:
        resolve(env={name: value})
    for needle in needles:
        assert needle in str(info.value), (name, needle, str(info.value))


BAD_CLI = {
    "unknown section": ({"nosuch.key": "1"}, ["'nosuch.key'", "command line"]),
    "unknown key": ({"l3.nosuch": "1"}, ["'l3.nosuch'", "command line", "l3.backend"]),
    "key without section": ({"workers": "2"}, ["'workers'"]),
    "bad choice": ({"log.level": "loud"}, ["log.level", "'loud'", "debug, info, warning, error"]),
    "bad size": ({"host.budget": "a lot"}, ["host.budget", "'a lot'"]),
    "bad int": ({"server.max_batch_pages": "1e3"}, ["server.max_batch_pages", "'1e3'"]),
    "non-positive": ({"l3.io_workers": "0"}, ["l3.io_workers", "'0'", "> 0"]),
    "lease below min": ({"sessions.lease_ms": "499"}, ["sessions.lease_ms", "499", "500"]),
    "backend option": ({"l3.s3.threads": "many"}, ["l3.s3.threads", "'many'", "an integer"]),
    # Not numbers a range check can hold: nan passes "x <= 0" (it killed the stats task).
    "nan": ({"l3.stats_interval_s": "nan"}, ["l3.stats_interval_s", "'nan'"]),
    "infinite": ({"l3.redis.socket_timeout_s": "inf"}, ["l3.redis.socket_timeout_s", "'inf'"]),
    "mode beyond permission bits": ({"server.socket_mode": "1777"}, ["server.socket_mode", "'1777'"]),
    "mode not octal": ({"server.socket_mode": "689"}, ["server.socket_mode", "'689'"]),
    "tenant without uids": ({"sessions.tenant_uids": "team-a="}, ["sessions.tenant_uids", "'team-a'"]),
    "tenant uid not a number": ({"sessions.tenant_uids": "team-a=root"}, ["sessions.tenant_uids", "'root'"]),
    "tenant listed twice": ({"sessions.tenant_uids": "a=1;a=2"}, ["sessions.tenant_uids", "listed twice"]),
    "tenant name": ({"sessions.tenant_uids": "a b=1"}, ["sessions.tenant_uids", "'a b=1'"]),
    # A review (stop 41): these started and failed later, as a traceback or a misleading error.
    "NUL in a path": ({"server.socket": "/x/a\0b"}, ["server.socket", "without NUL"]),
    "NUL in a string": ({"l3.file.path": "/x/a\0b"}, ["l3.file.path", "without NUL"]),
    "empty socket path": ({"server.socket": ""}, ["server.socket", "not empty"]),
    "socket where the admin socket goes": (
        {"server.socket": "/x/admin.sock"},
        ["'/x/admin.sock'", "must differ from server.socket"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CLI))
def test_invalid_flag_names_key_and_value(case: str) -> None:
    cli, needles = BAD_CLI[case]
    with pytest.raises(ConfigError) as info:
        resolve(cli=cli, env={})
    for needle in needles:
        assert needle in str(info.value), (case, needle, str(info.value))


@pytest.mark.parametrize(
    ("key", "value"), [("server.tls_cert", "/etc/c.pem"), ("server.tls_key", "/etc/k.pem")]
)
def test_tls_cert_and_key_must_come_together(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(cli={key: value}, env={})
    message = str(info.value)
    assert "server.tls_cert" in message and "server.tls_key" in message
    assert value in message, f"the message does not name the value that was set: {message!r}"


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError) as info:
        resolve(env={}, file=missing)
    assert str(missing) in str(info.value) and "No such file" in str(info.value)
    with pytest.raises(ConfigError) as info:
        resolve(env={}, file=tmp_path)  # a directory
    assert str(tmp_path) in str(info.value)


def test_bad_toml_names_the_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "[server]\nsocket = \n")
    with pytest.raises(ConfigError) as info:
        resolve(env={}, file=path)
    assert str(path) in str(info.value) and "not valid TOML" in str(info.value)
    assert "line 2" in str(info.value)


def _cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "hicached", *args],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_config_show_prints_toml_that_round_trips(tmp_path: Path) -> None:
    path = _write(tmp_path, "[l3]\nbackend = 'none'\ncapacity = '3GiB'\n[host]\nprefault = false\n")
    shown = _cli(
        "config", "show", "--config", str(path), "--lease-ms", "4000", "--set", "copy.workers=3",
        env={"HICACHED_LOG_FORMAT": "json"},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    data = tomllib.loads(shown.stdout)
    expected = resolve(
        cli={"sessions.lease_ms": "4000", "copy.workers": "3"}, env={"HICACHED_LOG_FORMAT": "json"}, file=path
    )
    assert data == as_dict(expected)
    assert (data["l3"]["file"]["capacity_bytes"], data["host"]["prefault"], data["log"]["format"]) == (
        3 << 30,
        False,
        "json",
    )
    again = resolve(env={}, file=_write(tmp_path, shown.stdout))
    assert again == expected


def test_tenant_uids_are_parsed_once_and_written_back_as_text(tmp_path: Path) -> None:
    """``sessions.tenant_uids`` holds tenant -> uids (parsed when resolved, not again by its
    users), read-only, and ``config show`` writes the text that reads back to it."""
    cfg = resolve(cli={"sessions.tenant_uids": "team-b=1002; team-a=1001,1000"}, env={})
    assert cfg.sessions.tenant_uids == {"team-b": frozenset({1002}), "team-a": frozenset({1000, 1001})}
    with pytest.raises(TypeError):
        cfg.sessions.tenant_uids["team-c"] = frozenset({1})  # type: ignore[index]
    assert as_dict(cfg)["sessions"]["tenant_uids"] == "team-b=1002;team-a=1000,1001"
    assert resolve(env={}, file=_write(tmp_path, to_toml(cfg))) == cfg
    assert resolve(env={}).sessions.tenant_uids == {}


def test_config_show_rejects_an_invalid_value_with_exit_2() -> None:
    shown = _cli("config", "show", "--set", "copy.workers=-1")
    assert shown.returncode == 2
    assert "copy.workers" in shown.stderr and "'-1'" in shown.stderr
    assert shown.stdout == ""


@pytest.mark.parametrize("source", ["flag", "env", "file"])
def test_serve_with_an_invalid_value_exits_2_and_starts_nothing(source: str, tmp_path: Path) -> None:
    sock = tmp_path / "d.sock"
    prefix = f"hcdcfg{os.getpid()}{uuid.uuid4().hex[:6]}"
    args = [
        "serve", "--socket", str(sock), "--l3", "file", "--l3-path", str(tmp_path / "l3"),
        "--metrics-port", "0", "--set", f"host.shm_prefix={prefix}",
    ]  # fmt: skip
    env: dict[str, str] = {}
    if source == "flag":
        args += ["--set", "l3.write_policy=eventually"]
    elif source == "env":
        env["HICACHED_L3_WRITE_POLICY"] = "eventually"
    else:
        args += ["--config", str(_write(tmp_path, "[l3]\nwrite_policy = 'eventually'\n"))]
    result = _cli(*args, env=env)
    assert result.returncode == 2
    assert "configuration error" in result.stderr
    assert "l3.write_policy" in result.stderr and "'eventually'" in result.stderr
    assert result.stdout == ""
    assert not sock.exists(), "no socket was created"
    assert not (tmp_path / "l3").exists(), "no L3 directory was created"
    assert not list(Path("/dev/shm").glob(f"{prefix}*")), "no shared memory was created"


# Values the type allows but that cannot work. Before each check, serve started with it and
# failed later: a traceback at start (shm_prefix, max_message_bytes, listen), every client's
# Attach refused (a 190-character prefix), a crash at SIGTERM (grace_s), or a silent 0 that
# switched to host.budget_fraction (a size below one byte).
UNWORKABLE = {
    "shm_prefix with a slash": (["--set", "host.shm_prefix=a/b"], ["host.shm_prefix", "'a/b'"]),
    "shm_prefix too long": (["--set", f"host.shm_prefix={'p' * 190}"], ["host.shm_prefix", "1..64"]),
    "message size over C int": (["--set", "server.max_message_bytes=8GiB"], ["server.max_message_bytes"]),
    "grace beyond a day": (["--set", "server.grace_s=1e12"], ["server.grace_s", "86400"]),
    "listen not HOST:PORT": (
        ["--listen", "nonsense", "--set", "server.insecure_tcp=true"],
        ["server.listen", "'nonsense'", "HOST:PORT"],
    ),
    # Before, without a token the error asked for one, and only then for HOST:PORT.
    "listen not HOST:PORT, no token": (["--listen", ":50051"], ["server.listen", "':50051'", "HOST:PORT"]),
    "size below one byte": (["--set", "host.budget=0.0001KiB"], ["host.budget", "'0.0001KiB'", "whole"]),
    "fractional byte": (["--set", "copy.max_queued=1.5"], ["copy.max_queued", "'1.5'"]),
}


@pytest.mark.parametrize("case", sorted(UNWORKABLE))
def test_serve_refuses_a_value_that_cannot_work_in_one_line(case: str, tmp_path: Path) -> None:
    flags, needles = UNWORKABLE[case]
    sock = tmp_path / "d.sock"
    prefix = f"hcdbad{os.getpid()}{uuid.uuid4().hex[:6]}"  # a flag of the case may override it
    result = _cli(
        "serve", "--socket", str(sock), "--l3", "none", "--metrics-port", "-1",
        "--set", f"host.shm_prefix={prefix}", *flags, timeout=20,
    )  # fmt: skip
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hicached: "), result.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], (case, needle, lines[0])
    assert list(tmp_path.iterdir()) == [], "nothing was created"


def test_whole_sizes_with_a_fraction_still_parse() -> None:
    cfg = resolve(cli={"host.budget": "1.5KiB", "copy.max_queued": "0.5MiB"}, env={})
    assert (cfg.host.budget, cfg.copy.max_queued) == (1536, 512 << 10)


def test_a_backend_built_from_its_own_defaults_has_the_daemons_defaults() -> None:
    """Each backend's option dataclass is the one place its defaults live: a backend built
    from a table with only its required options (as a test or a tool builds one) gets what
    the daemon's configuration shows. Before, the file backend's own capacity was 64 GiB
    against the daemon's 16 GiB."""
    cfg = Config()
    for name in ("file", "redis", "s3", "mooncake"):
        section = getattr(cfg.l3, name)
        required = {
            f.name: getattr(section, f.name)
            for f in dataclasses.fields(section)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        assert type(section)(**required) == section, name
