"""deploy/ as it behaves, beyond its schema: the sidecar's SGLang really loads hicached
(flags parsed by SGLang's own argument parser, the backend class imported by SGLang's own
factory), its image carries hicached-client, one shutdown budget, the socket directory the
daemon will accept, and comments that name only configuration keys that exist.

Each test here would have failed on deploy/ before issue 11's item 7 (said per test)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from hicached.config import Config, resolve
from hicached.shutdown import JOURNAL_MARGIN_S, flush_within, rpc_grace_s

from .dockerfile import parse, read_dockerignore
from .test_deploy import DEPLOY, ROOT, Manifest, flag_values, only, pod_containers, render

SIDECAR = DEPLOY / "examples" / "sidecar"
WORKER_DOCKERFILE = SIDECAR / "worker.Dockerfile"
WORKLOADS = {"base": DEPLOY / "base", "examples/sidecar": SIDECAR}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    return {name: render(path) for name, path in WORKLOADS.items()}


def pod_spec(docs: list[Manifest]) -> Manifest:
    workload = next(d for d in docs if d["kind"] in ("DaemonSet", "Deployment"))
    spec: Manifest = workload["spec"]["template"]["spec"]
    return spec


def daemon_config(docs: list[Manifest], tmp_path: Path) -> Config:
    toml_file = tmp_path / "hicached.toml"
    toml_file.write_text(only(docs, "ConfigMap")["data"]["hicached.toml"])
    return resolve(env={}, file=toml_file)


def container(spec: Manifest, name: str) -> Manifest:
    return next(c for c in pod_containers(spec) if c["name"] == name)


# ---- the sidecar's SGLang uses hicached ----------------------------------------------


def sglang_args(rendered: dict[str, list[Manifest]]) -> argparse.Namespace:
    from hicached_client.sglang.cpu_compat import ensure_sglang_importable

    ensure_sglang_importable()
    from sglang.srt.server_args import ServerArgs

    worker = container(pod_spec(rendered["examples/sidecar"]), "worker")
    assert worker["command"][-1] == "sglang.launch_server"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(worker["args"])


def test_sidecar_sglang_loads_the_hicached_backend(rendered: dict[str, list[Manifest]]) -> None:
    """The worker's args, parsed by SGLang 0.5.23's own parser, turn on HiCache with the
    `dynamic` storage backend whose class SGLang's factory imports as HiCachedStorage,
    pointed at the sidecar's socket. (Before: only --enable-hierarchical-cache, so SGLang
    never talked to hicached.)"""
    from hicached_client.sglang.config import AdapterConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    args = sglang_args(rendered)
    assert args.enable_hierarchical_cache is True
    assert args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    cls = StorageBackendFactory._load_backend_class(
        extra["module_path"], extra["class_name"], extra["backend_name"]
    )
    assert cls.__name__ == "HiCachedStorage" and cls.__module__.startswith("hicached_client.sglang")
    assert extra.get("interface_v1") == 1, "the zero-copy v1 API (docs/sglang.md)"
    adapter = AdapterConfig.from_extra_config(extra)
    sidecar = container(pod_spec(rendered["examples/sidecar"]), "hicached")
    assert adapter.target == f"unix://{flag_values(sidecar['args'])['--socket']}"


def test_sidecar_worker_image_is_built_with_hicached_client(rendered: dict[str, list[Manifest]]) -> None:
    """The worker container's image is the one worker.Dockerfile builds: SGLang's image at the
    version hicached-client's `sglang` extra pins, plus the client wheel of this checkout.
    (Before: plain lmsysorg/sglang, which has no hicached_client to import.)"""
    worker = container(pod_spec(rendered["examples/sidecar"]), "worker")
    images = {i["name"]: i for i in yaml_load(SIDECAR / "kustomization.yaml")["images"]}
    built = images["sglang-hicached"]
    assert worker["image"] == f"{built['newName']}:{built['newTag']}"

    stages = parse(WORKER_DOCKERFILE)
    final = stages[-1]
    base_arg = next(
        line for line in WORKER_DOCKERFILE.read_text().splitlines() if line.startswith("ARG SGLANG_IMAGE=")
    )
    assert final.base == "${SGLANG_IMAGE}"
    client = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())["project"]
    (pin,) = [d for d in client["optional-dependencies"]["sglang"] if d.startswith("sglang==")]
    assert f"lmsysorg/sglang:v{pin.removeprefix('sglang==')}-" in base_arg
    wheel = f"hicached_client-{client['version']}-py3-none-any.whl"
    runs = " ".join(r.value for r in final.all("RUN"))
    assert wheel in runs and "import hicached_client.sglang" in runs
    assert built["newTag"].endswith(f"client{client['version']}")


def yaml_load(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def test_worker_dockerfile_lints_and_its_builder_makes_the_client_wheel(tmp_path: Path) -> None:
    """hadolint is clean, and replaying the builder stage on its build context (the root
    .dockerignore applies) produces exactly the wheel the final stage installs."""
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    lint = subprocess.run(
        [hadolint, "--no-color", str(WORKER_DOCKERFILE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr

    from .dockerfile import dockerignore_excludes

    patterns = read_dockerignore(ROOT / ".dockerignore")
    builder = next(s for s in parse(WORKER_DOCKERFILE) if s.name == "builder")
    context = tmp_path / "context"
    for copy in builder.all("COPY"):
        *sources, _dest = copy.value.split()
        for source in sources:
            rel = source.rstrip("/")
            assert not dockerignore_excludes(patterns, rel), rel
            src, dst = ROOT / rel, context / rel
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
    wheels = tmp_path / "wheels"
    for run in builder.all("RUN")[1:]:  # the first installs the pinned tools: the dev extra here
        result = subprocess.run(
            ["bash", "-o", "pipefail", "-c", run.value.replace("/wheels", str(wheels))],
            check=False,
            cwd=context,
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, result.stdout + result.stderr
    built = sorted(p.name for p in wheels.iterdir())
    runs = " ".join(r.value for r in parse(WORKER_DOCKERFILE)[-1].all("RUN"))
    assert len(built) == 1 and built[0] in runs, built


# ---- one shutdown budget -------------------------------------------------------------


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_shutdown_fits_the_pods_grace_period(
    workload: str, rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    """terminationGracePeriodSeconds >= [server] grace_s (stop + L3 flush) + the journal margin,
    set explicitly, and no preStop hook spends the same budget unseen. (Before: the sidecar
    pod had the default 30 s for a worker plus a 20 s daemon grace, flushed once per index.)"""
    docs = rendered[workload]
    spec = pod_spec(docs)
    config = daemon_config(docs, tmp_path)
    assert "terminationGracePeriodSeconds" in spec, "the default (30 s) is nobody's choice"
    period = spec["terminationGracePeriodSeconds"]
    assert config.server.grace_s + JOURNAL_MARGIN_S <= period, (config.server.grace_s, period)
    for c in pod_containers(spec):
        assert "preStop" not in c.get("lifecycle", {}), c["name"]
    if workload == "examples/sidecar":  # the worker stops first, inside the same period
        assert period - config.server.grace_s - JOURNAL_MARGIN_S >= 30, "the worker's own share"


class SlowIndex:
    """An index whose flush uses all the time it is given (an L3 that never catches up)."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.given: list[float] = []

    def flush(self, timeout_s: float | None = None) -> int:
        assert timeout_s is not None
        self.given.append(timeout_s)
        self.clock[0] += timeout_s
        return 1


def test_flush_of_many_indexes_stays_inside_one_budget() -> None:
    """Five pool groups with a stalled L3: the flushes together end at the deadline. (Before:
    Daemon.stop gave grace_s to the RPC stop and grace_s again to each index's flush, 6x the budget.)"""
    now = [100.0]
    indexes = [SlowIndex(now) for _ in range(5)]
    budget = 45.0
    deadline = now[0] + budget
    now[0] += rpc_grace_s(budget)  # the RPC stop used its whole share
    flush_within(indexes, deadline, clock=lambda: now[0])
    assert now[0] <= deadline
    assert sum(sum(i.given) for i in indexes) == pytest.approx(budget - rpc_grace_s(budget))
    assert indexes[-1].given == [], "nothing is started after the deadline"


# ---- the socket directory the daemon accepts -----------------------------------------


def test_sidecar_socket_directory_is_one_the_daemon_accepts(
    rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    """The kubelet creates an emptyDir world-writable (0777, setgid with fsGroup); the daemon
    refuses a socket directory others can write. The sidecar's socket therefore lives in a
    directory the daemon creates inside the emptyDir. (Before: directly in the emptyDir, so the
    daemon would refuse to start.)"""
    from hicached.errors import StartupError
    from hicached.server.sockets import prepare_dir

    spec = pod_spec(rendered["examples/sidecar"])
    sidecar = container(spec, "hicached")
    socket = Path(flag_values(sidecar["args"])["--socket"])
    mount = next(m for m in sidecar["volumeMounts"] if socket.is_relative_to(m["mountPath"]))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    os.chmod(empty_dir, 0o2777)  # what the kubelet leaves
    directory = empty_dir / socket.parent.relative_to(mount["mountPath"])
    if directory == empty_dir:
        with pytest.raises(StartupError):
            prepare_dir(directory, gid=None)
        pytest.fail("the socket sits directly in the world-writable emptyDir")
    prepare_dir(directory, gid=None)
    assert directory.stat().st_mode & 0o777 == 0o700
    with pytest.raises(StartupError, match="writable by others"):
        prepare_dir(empty_dir, gid=None)  # the check is real


# ---- comments name real keys ---------------------------------------------------------


def config_keys() -> set[str]:
    keys: set[str] = set()

    def walk(prefix: str, obj: object) -> None:
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            name = f"{prefix}.{f.name}" if prefix else f.name
            keys.add(name)
            if dataclasses.is_dataclass(value):
                walk(name, value)

    walk("", resolve(env={}))
    return keys


def test_comments_name_only_existing_config_keys() -> None:
    """Every `[section].key` / `[section] key` named in deploy/ and docs/deploy.md exists in
    hicached.config. (Before: the memory-limit comments named `[host].size_bytes`, no such key.)"""
    keys = config_keys()
    pattern = re.compile(r"\[([a-z0-9_.]+)\]\.?\s?`?([a-z_][a-z0-9_]*)")
    files = [*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.toml"), ROOT / "docs" / "deploy.md"]
    found = 0
    for path in files:
        for line in path.read_text().splitlines():
            text = line.split("#", 1)[1] if path.suffix in (".yaml", ".toml") and "#" in line else line
            for section, key in pattern.findall(text):
                if section in {"host", "server", "l3", "copy", "sessions", "log"} or section.startswith(
                    "l3."
                ):
                    found += 1
                    assert f"{section}.{key}" in keys, f"{path.relative_to(ROOT)}: [{section}] {key}"
    assert found >= 5
    assert "host.size_bytes" not in keys  # the name the old comments used
