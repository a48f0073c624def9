"""Issue 11 item 5: the configuration as a user meets it on the command line, run in a fresh
working directory: ``config show`` round-trips (modes in octal), octal modes are accepted
and written as such, a bare decimal mode in TOML is refused, unknown ``HICACHED_*``
variables are warned about, ``--keys`` prints no Python reprs, ``--version`` and help
texts with defaults.

Before this change ``config show`` printed ``socket_mode = 432``, ``--set
server.socket_mode=660`` was silently decimal (mode 0o1224), a typo'd variable was
ignored, ``--keys`` printed ``PosixPath(...)`` and there was no ``--version``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

import hicached
from hicached.config import resolve
from hicached.testing.daemon import launch, scratch_dir
from tests.acceptance.cfg_serve import hicached as run
from tests.acceptance.cfg_serve import serve

CONFIG = """
[server]
socket_mode = 0o600

[l3]
backend = "redis"

[l3.redis]
host = "10.1.2.3"
port = 7000
key_prefix = "team-a/"

[l3.s3]
bucket = "pages"
prefix = "hicached/prod/"
"""


def test_config_show_round_trips_with_backend_tables_and_octal_modes(tmp_path: Path) -> None:
    (tmp_path / "in.toml").write_text(CONFIG)
    shown = run("config", "show", "--config", "in.toml", "--set", "l3.redis.db=2", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "socket_mode = 0o600\n" in shown.stdout
    assert "[l3.redis]\n" in shown.stdout
    data = tomllib.loads(shown.stdout)
    assert data["l3"]["redis"] == {**data["l3"]["redis"], "host": "10.1.2.3", "port": 7000, "db": 2}
    assert data["l3"]["s3"]["prefix"] == "hicached/prod/"
    (tmp_path / "out.toml").write_text(shown.stdout)
    again = run("config", "show", "--config", "out.toml", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout == shown.stdout
    assert resolve(env={}, file=tmp_path / "out.toml") == resolve(
        cli={"l3.redis.db": "2"}, env={}, file=tmp_path / "in.toml"
    )


@pytest.mark.parametrize("text", ["660", "0660", "0o660"])
def test_text_modes_are_octal(text: str, tmp_path: Path) -> None:
    shown = run("config", "show", "--set", f"server.socket_mode={text}", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "socket_mode = 0o660\n" in shown.stdout
    env = run("config", "show", cwd=tmp_path, env={"HICACHED_SERVER_SOCKET_MODE": text})
    assert "socket_mode = 0o660\n" in env.stdout


@pytest.mark.parametrize("literal", ["660", "432", "0x1b0"])
def test_a_bare_number_mode_in_toml_is_refused(literal: str, tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text(f"[server]\nsocket_mode = {literal}\n")
    shown = run("config", "show", "--config", "c.toml", cwd=tmp_path)
    assert shown.returncode == 2 and shown.stdout == ""
    assert "server.socket_mode" in shown.stderr and "0o660" in shown.stderr, shown.stderr


def test_mode_outside_permission_bits_is_refused(tmp_path: Path) -> None:
    shown = run("config", "show", "--set", "server.socket_mode=1777", cwd=tmp_path)
    assert shown.returncode == 2 and "server.socket_mode" in shown.stderr, shown.stderr


def test_unknown_hicached_variable_is_warned_about(tmp_path: Path) -> None:
    clients = {"HICACHED_SOCKET": "unix:///y", "HICACHED_ADMIN_SOCKET": "/z", "HICACHED_DAEMON_UID": "10001"}
    shown = run("config", "show", cwd=tmp_path, env={"HICACHED_L3_PAHT": "/x", **clients})
    assert shown.returncode == 0, shown.stderr
    assert "HICACHED_L3_PAHT" in shown.stderr and "did you mean HICACHED_L3_PATH" in shown.stderr
    # Client variables are no typos (before: HICACHED_ADMIN_SOCKET, which `hicached status`
    # reads, and HICACHED_DAEMON_UID, which the docs tell workers to set, were warned about
    # as "not a hicached setting and is ignored").
    for name in clients:
        assert name not in shown.stderr, (name, shown.stderr)


def test_serve_logs_the_unknown_variable_warning(tmp_path: Path) -> None:
    served = serve(
        tmp_path, '[l3]\nbackend = "none"\n[host]\nbudget = "64MiB"\n', env={"HICACHED_L3_REDIS_PROT": "1"}
    )
    try:
        assert "HICACHED_L3_REDIS_PROT" in served.log and "HICACHED_L3_REDIS_PORT" in served.log, served.log
    finally:
        assert served.stop() == 0
        served.cleanup()


def test_removed_loose_key_names_its_replacement(tmp_path: Path) -> None:
    shown = run("config", "show", "--set", "l3.url=redis://h:1/0", cwd=tmp_path)
    assert shown.returncode == 2
    assert "l3.url" in shown.stderr and "l3.redis.host" in shown.stderr, shown.stderr


def test_aliases_of_the_file_backend_keep_working(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[l3]\npath = "/data/l3"\ncapacity = "2GiB"\n')
    shown = run("config", "show", "--config", "c.toml", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    data = tomllib.loads(shown.stdout)
    assert data["l3"]["file"]["path"] == "/data/l3" and data["l3"]["file"]["capacity_bytes"] == 2 << 30


def test_keys_lists_every_key_without_python_reprs(tmp_path: Path) -> None:
    keys = run("config", "show", "--keys", cwd=tmp_path)
    assert keys.returncode == 0, keys.stderr
    assert "PosixPath" not in keys.stdout
    lines = {line.split()[0]: line for line in keys.stdout.splitlines()}
    defaults = {key: line.split()[1] for key, line in lines.items()}
    assert not [d for d in defaults.values() if d.startswith("'")], "defaults are TOML values, not reprs"
    assert "0o660" in lines["server.socket_mode"]
    for key in ("l3.redis.host", "l3.s3.access_key_id", "l3.mooncake.master_addr", "l3.file.path"):
        assert key in lines, key
    assert "HICACHED_L3_REDIS_HOST" in lines["l3.redis.host"]


def test_version_and_help(tmp_path: Path) -> None:
    version = run("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"hicached {hicached.__version__}"
    for command in (["serve", "--help"], ["config", "show", "--help"]):
        helped = run(*command, cwd=tmp_path)
        assert helped.returncode == 0, helped.stderr
        assert "default" in helped.stdout
        assert "``" not in helped.stdout and ":func:" not in helped.stdout, "no internal docstrings"
    serve_help = run("serve", "--help", cwd=tmp_path).stdout
    assert "l3.file.path" in serve_help and "default: 10000" in serve_help.replace("\n", " ").replace(
        "  ", " "
    )


def test_config_show_as_json_is_the_same_configuration(tmp_path: Path) -> None:
    """`config show --format json`: the same resolved values as the TOML form, flags included."""
    import json

    (tmp_path / "in.toml").write_text(CONFIG)
    args = ("config", "show", "--config", "in.toml", "--log-level", "debug")
    as_toml = run(*args, cwd=tmp_path)
    as_json = run(*args, "--format", "json", cwd=tmp_path)
    assert as_toml.returncode == as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["log"]["level"] == "debug" and data["l3"]["redis"]["key_prefix"] == "team-a/"
    assert data["l3"]["redis"] == tomllib.loads(as_toml.stdout)["l3"]["redis"]


def test_hostile_or_mistaken_command_lines_are_usage_errors_quoting_a_prefix(tmp_path: Path) -> None:
    """Fails before (a review of stop 45): ``--set`` without ``=`` exited 1 quoting the whole
    argument; an unknown 5,000-character key came back whole; a variable's name reached the
    terminal with its escape bytes; ``server = 3`` was "unknown section [server]" listing
    server; a FIFO named by $HICACHED_CONFIG was reported twice over; the bench took 0 soak
    workers and -1 seconds; ``--socket`` and ``--target`` together, or a key given by its flag
    and by ``--set``, used one silently; and
    `keys --help` said "(default: None)" of its required flags."""
    blob = "k" * 5000
    for args, said in (
        (["serve", "--set", "x" * 3000], "--set expects SECTION.KEY=VALUE, got 'xxx"),
        (["config", "show", "--set", f"{blob}=1"], "unknown configuration key 'kkk"),
        (["bench", "--suite", "soak", "--soak-workers", "0"], "'0' is not an integer in [1, 2**31)"),
        (["bench", "--suite", "soak", "--soak-seconds", "-1"], "'-1' is not a number of seconds above 0"),
        (["status", "--socket", "/x/d.sock", "--target", "h:1"], "not allowed with argument"),
        (
            ["config", "show", "--host-budget", "3GiB", "--set", "host.budget=4GiB"],
            "host.budget is given twice",
        ),
        # An alias is its key (a review of stop 47: these kept one silently).
        (["config", "show", "--l3-path", "/a", "--set", "l3.path=/b"], "l3.file.path is given twice"),
        (["config", "show", "--set", "l3.path=/a", "--set", "l3.file.path=/b"], "is given twice by --set"),
        # Each check of a value quotes a prefix of it (a review of stop 49: these five kinds
        # quoted all 3,000 characters, a TOML file's 1,000,000).
        (["config", "show", "--set", f"host.shm_prefix={blob}"], "invalid host.shm_prefix = 'kkk"),
        (["config", "show", "--set", f"server.listen={blob}"], "invalid server.listen = 'kkk"),
        (
            [
                "config",
                "show",
                "--l3",
                "s3",
                "--set",
                "l3.s3.bucket=b",
                "--set",
                f"l3.s3.addressing_style={blob}",
            ],
            "'addressing_style'",
        ),
        (["config", "show", "--l3", "mooncake", "--set", f"l3.mooncake.protocol={blob}"], "'protocol'"),
        (
            ["config", "show", "--l3", "redis", "--set", f"l3.redis.ttl_s=-{'1' * 3000}"],
            "'ttl_s' must be >= 0",
        ),
    ):
        out = run(*args, cwd=tmp_path)
        assert out.returncode == 2 and said in out.stderr, (args[:2], out.stderr[-500:])
        assert len(out.stderr) < 600, (args[:2], len(out.stderr))
    shown = run("config", "show", cwd=tmp_path, env={"HICACHED_X\x1b[31m": "1"})
    assert "\x1b" not in shown.stderr and "HICACHED_X\\x1b[31m" in shown.stderr, shown.stderr
    (tmp_path / "two.toml").write_text('[l3]\npath = "/t1"\n[l3.file]\npath = "/t2"\n')
    out = run("config", "show", "--config", "two.toml", cwd=tmp_path)
    assert out.returncode == 2 and "l3.file.path is given twice in two.toml" in out.stderr, out.stderr
    out = run("config", "show", cwd=tmp_path, env={"HICACHED_L3_PATH": "/a", "HICACHED_L3_FILE_PATH": "/b"})
    assert out.returncode == 2 and "by HICACHED_L3_PATH and by HICACHED_L3_FILE_PATH" in out.stderr, (
        out.stderr
    )
    (tmp_path / "bad.toml").write_text("server = 3\n")
    out = run("config", "show", "--config", "bad.toml", cwd=tmp_path)
    assert out.returncode == 2 and "[server] in bad.toml must be a table of keys, got 3" in out.stderr
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    out = run("config", "show", cwd=tmp_path, env={"HICACHED_CONFIG": str(fifo)})
    assert out.returncode == 2 and out.stderr.count(str(fifo)) == 1, out.stderr
    assert "(default: None)" not in run("keys", "--help", cwd=tmp_path).stdout


def test_serve_says_when_clients_look_for_it_elsewhere() -> None:
    """Fails before (a review of stop 47): with ``$HICACHED_SOCKET`` exported, a plain
    ``hicached serve`` served its default socket without a word, and ``status`` (which reads
    the variable) waited for it where it was not. It still serves ``server.socket`` (the
    daemon does not read the clients' variable), and says so when they differ."""
    said = "is where clients look, but this daemon serves"
    for elsewhere in (True, False):
        workdir = scratch_dir()
        sock = workdir / "d.sock"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
        env["HICACHED_SOCKET"] = str(workdir / "other.sock") if elsewhere else f"unix://{sock}"
        d = launch(
            "--l3", "none", "--host-budget", "64MiB", workdir=workdir, socket=sock, env=env, clean_env=False
        )
        try:
            lines = [line for line in d.log.splitlines() if said in line]
            assert bool(lines) is elsewhere, d.log[-2000:]
            if elsewhere:
                assert "other.sock" in lines[0] and str(sock) in lines[0], lines[0]
        finally:
            d.stop()


def test_serve_warns_of_a_host_budget_the_machine_cannot_hold() -> None:
    """Fails before (a review of stop 47): a budget past the machine's memory and /dev/shm was
    accepted without a word (the README says both must fit), and attaches failed later."""
    said = "is larger than"
    for budget, warned in (("1024TiB", True), ("64MiB", False)):
        d = launch("--l3", "none", "--host-budget", budget)
        try:
            lines = [line for line in d.log.splitlines() if "host budget" in line and said in line]
            assert bool(lines) is warned, d.log[-2000:]
            if warned:
                assert any("the machine's memory" in line for line in lines), lines
        finally:
            d.stop()
