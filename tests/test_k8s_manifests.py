"""Is deploy/k8s something a platform team can apply? Every overlay is rendered with
kustomize, validated by kubeconform in strict mode against the Kubernetes 1.34 schemas
and the CloudNativePG CRDs (nothing skipped for want of a schema), and the rendered
objects are held to the policies a careful review would check: probes, sizes,
restricted pods, pinned images, PDBs and HPAs in prod, no secret values, and network
edges that are exactly the ones cairn uses.

kubeconform is built from the Go module proxy at a pinned version; the schemas come
from pip `kubernetes-validate`, whose `$ref`s point at `/api/_definitions.json` and so
are rewritten to the local file; the CRDs are kept in ../shared/k8s/crds and their
openAPIV3Schema converted to strict JSON schemas. All of it is written under build/.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
BUILD = REPO / "build" / "k8s"
CRDS = REPO.parent / "shared" / "k8s" / "crds"
OVERLAYS = ("dev", "prod")
KUBECONFORM_MODULE = "github.com/yannh/kubeconform/cmd/kubeconform"
KUBECONFORM_VERSION = "v0.8.0"
KUBERNETES_VERSION = "1.34.0"

PYTHON_SERVICES = {"gateway": 50051, "retrieval": 50052, "memory": 50053, "orchestrator": 50054}
SERVICES = (*PYTHON_SERVICES, "restproxy")

pytestmark = pytest.mark.timeout(600)

Obj = dict[str, Any]


# --- building the tools and the schemas -------------------------------------------------


@pytest.fixture(scope="session")
def kubeconform() -> Path:
    binary = BUILD / "bin" / "kubeconform"
    if binary.exists():
        shown = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
        if shown.stdout.strip() == KUBECONFORM_VERSION:
            return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["go", "install", f"{KUBECONFORM_MODULE}@{KUBECONFORM_VERSION}"],
        env={**os.environ, "GOBIN": str(binary.parent), "GOFLAGS": "-buildvcs=false"},
        check=True,
        capture_output=True,
        timeout=540,
    )
    return binary


def _strict(schema: Any) -> Any:
    """An openAPIV3Schema as a JSON schema that refuses unknown fields, as the API
    server does for a CRD (kubeconform's -strict does this only for its own schemas)."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _crd_schema(openapi: Obj, *, group: str, version: str, kind: str) -> Obj:
    schema = _strict(copy.deepcopy(openapi))
    properties = schema.setdefault("properties", {})
    properties["apiVersion"] = {"type": "string", "enum": [f"{group}/{version}"]}
    properties["kind"] = {"type": "string", "enum": [kind]}
    properties["metadata"] = {"type": "object"}
    return dict(schema)


@pytest.fixture(scope="session")
def schema_dir() -> Path:
    root = BUILD / "schemas"
    shutil.rmtree(root, ignore_errors=True)
    source = (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema"
        / f"v{KUBERNETES_VERSION}-local-strict"
    )
    target = root / f"v{KUBERNETES_VERSION}-standalone-strict"
    target.mkdir(parents=True)
    definitions = (target / "_definitions.json").as_uri()
    for path in source.glob("*.json"):
        text = path.read_text(encoding="utf-8")
        # The files carry `$id`s under https://kubernetes.io/api/, so a relative
        # reference would resolve to the web; an absolute file URL cannot.
        (target / path.name).write_text(
            text.replace('"/api/_definitions.json#', f'"{definitions}#'), encoding="utf-8"
        )
    for crd_file in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(crd_file.read_text(encoding="utf-8"))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            out = root / "crds" / group / f"{kind.lower()}_{version['name']}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            schema = _crd_schema(
                version["schema"]["openAPIV3Schema"],
                group=group,
                version=version["name"],
                kind=kind,
            )
            out.write_text(json.dumps(schema), encoding="utf-8")
    return root


def _render(overlay: str) -> str:
    return subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout


@pytest.fixture(scope="session")
def rendered() -> dict[str, str]:
    return {overlay: _render(overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="session")
def objects(rendered: dict[str, str]) -> dict[str, list[Obj]]:
    return {
        overlay: [doc for doc in yaml.safe_load_all(text) if doc]
        for overlay, text in rendered.items()
    }


def _kubeconform(binary: Path, schemas: Path, manifests: str) -> Obj:
    done = subprocess.run(
        [
            binary,
            "-strict",
            "-summary",
            "-output",
            "json",
            "-kubernetes-version",
            KUBERNETES_VERSION,
            "-schema-location",
            str(schemas)
            + "/{{ .NormalizedKubernetesVersion }}-standalone{{ .StrictSuffix }}"
            + "/{{ .ResourceKind }}{{ .KindSuffix }}.json",
            "-schema-location",
            str(schemas) + "/crds/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json",
            "-",
        ],
        input=manifests,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    report: Obj = json.loads(done.stdout)
    return report


# --- schema validation ------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_of_the_overlay_is_valid_for_kubernetes_1_34_and_cloudnativepg_with_none_skipped(
    overlay: str,
    kubeconform: Path,
    schema_dir: Path,
    rendered: dict[str, str],
    objects: dict[str, list[Obj]],
) -> None:
    report = _kubeconform(kubeconform, schema_dir, rendered[overlay])
    problems = [r for r in report.get("resources", []) if r.get("status") != "statusValid"]
    assert problems == []
    summary = report["summary"]
    assert summary == {
        "valid": len(objects[overlay]),
        "invalid": 0,
        "errors": 0,
        "skipped": 0,
    }
    kinds = {obj["kind"] for obj in objects[overlay]}
    assert {"Cluster", "Deployment", "StatefulSet", "NetworkPolicy"} <= kinds


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        ("Deployment", ("spec", "template", "spec", "containers", 0)),
        ("Cluster", ("spec",)),
        ("ScheduledBackup", ("spec",)),
    ],
)
def test_a_field_the_schema_does_not_know_is_an_error_for_core_kinds_and_crds(
    kind: str,
    path: tuple[str | int, ...],
    kubeconform: Path,
    schema_dir: Path,
    objects: dict[str, list[Obj]],
) -> None:
    obj = copy.deepcopy(next(o for o in objects["prod"] if o["kind"] == kind))
    node: Any = obj
    for step in path:
        node = node[step]
    node["replicaz"] = 3
    report = _kubeconform(kubeconform, schema_dir, yaml.safe_dump(obj))
    assert report["summary"]["invalid"] == 1
    assert "replicaz" in json.dumps(report["resources"])


# --- the rendered objects -----------------------------------------------------------------


def _of_kind(objs: list[Obj], *kinds: str) -> list[Obj]:
    return [obj for obj in objs if obj["kind"] in kinds]


def _workloads(objs: list[Obj]) -> list[Obj]:
    return _of_kind(objs, "Deployment", "StatefulSet")


def _containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj, Obj]]:
    for workload in _workloads(objs):
        pod = workload["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            yield workload, pod, container


def _short(workload: Obj) -> str:
    return str(workload["metadata"]["labels"]["app.kubernetes.io/name"])


def _env(container: Obj) -> dict[str, Obj]:
    return {item["name"]: item for item in container.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_startup_readiness_and_liveness_probes_on_a_declared_port(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    for workload, _pod, container in _containers(objects[overlay]):
        declared = {p["containerPort"] for p in container.get("ports", [])} | {
            p["name"] for p in container.get("ports", [])
        }
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            assert probe, f"{_short(workload)} has no {kind}"
            handler = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
            assert handler is not None, f"{_short(workload)} {kind} has no network check"
            assert handler["port"] in declared, f"{_short(workload)} {kind} on {handler['port']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_python_services_start_and_become_ready_by_grpc_health_and_the_proxy_by_http(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    seen = set()
    for workload, _pod, container in _containers(objects[overlay]):
        name = _short(workload)
        if name in PYTHON_SERVICES:
            for kind in ("startupProbe", "readinessProbe"):
                assert container[kind]["grpc"]["port"] == PYTHON_SERVICES[name]
            seen.add(name)
        if name == "restproxy":
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
            seen.add(name)
    assert seen == set(SERVICES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_cpu_and_memory_requests_and_limits(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    for workload, _pod, container in _containers(objects[overlay]):
        resources = container.get("resources", {})
        for bound in ("requests", "limits"):
            assert set(resources.get(bound, {})) >= {"cpu", "memory"}, (
                f"{_short(workload)} {bound}: {resources.get(bound)}"
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_restricted_non_root_read_only_no_capabilities_and_no_api_token(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    for workload, pod, container in _containers(objects[overlay]):
        name = _short(workload)
        assert pod.get("automountServiceAccountToken") is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["capabilities"] == {"drop": ["ALL"]}, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
    for account in _of_kind(objects[overlay], "ServiceAccount"):
        assert account.get("automountServiceAccountToken") is False


_PINNED = re.compile(r"^[^@\s]+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$")


def _is_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return bool(_PINNED.match(image))
    name, _, tag = image.rpartition(":")
    return bool(_PINNED.match(image)) and "/" not in tag and bool(name) and tag != "latest"


def test_an_image_is_pinned_only_by_a_version_tag_or_a_digest() -> None:
    assert _is_pinned("registry.example.com/cairn/gateway:0.1.0")
    assert _is_pinned("registry.example.com:5000/cairn/gateway@sha256:" + "a" * 64)
    assert not _is_pinned("registry.example.com:5000/cairn/gateway")
    assert not _is_pinned("docker.io/qdrant/qdrant:latest")
    assert not _is_pinned("qdrant/qdrant")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_is_pinned_never_latest(overlay: str, objects: dict[str, list[Obj]]) -> None:
    images = [container["image"] for _w, _p, container in _containers(objects[overlay])]
    images += [c["spec"]["imageName"] for c in _of_kind(objects[overlay], "Cluster")]
    assert images
    assert [image for image in images if not _is_pinned(image)] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_pod_is_given_more_time_to_stop_than_its_pause_and_its_drain(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    checked = 0
    for workload, pod, container in _containers(objects[overlay]):
        env = _env(container)
        if "CAIRN_SHUTDOWN_GRACE_SECONDS" not in env:
            continue
        grace = float(env["CAIRN_SHUTDOWN_GRACE_SECONDS"]["value"])
        pause = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pod["terminationGracePeriodSeconds"] > pause + grace, _short(workload)
        checked += 1
    assert checked == len(SERVICES)


def test_every_prod_deployment_has_three_replicas_an_hpa_a_pdb_and_spreads_over_zones_and_nodes(
    objects: dict[str, list[Obj]],
) -> None:
    prod = objects["prod"]
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h for h in _of_kind(prod, "HorizontalPodAutoscaler")
    }
    pdbs = [p["spec"]["selector"]["matchLabels"] for p in _of_kind(prod, "PodDisruptionBudget")]
    for workload in _workloads(prod):
        name = workload["metadata"]["name"]
        assert workload["spec"]["replicas"] >= 3, name
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(selector.items() <= labels.items() for selector in pdbs), f"{name}: no PDB"
        keys = {
            c["topologyKey"]
            for c in workload["spec"]["template"]["spec"].get("topologySpreadConstraints", [])
        }
        assert keys == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}, name
        if workload["kind"] == "Deployment":
            assert name in hpas, f"{name}: no HPA"
            assert hpas[name]["spec"]["minReplicas"] >= 3, name
    for workload in _workloads(objects["dev"]):
        assert workload["spec"]["replicas"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_carries_a_value_and_every_credential_comes_from_a_secret(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    for secret in _of_kind(objects[overlay], "Secret"):
        assert not secret.get("data") and not secret.get("stringData"), secret["metadata"]["name"]
    credential = re.compile(r"(KEY|TOKEN|PASSWORD|SECRET|DATABASE_URL)$")
    for workload, _pod, container in _containers(objects[overlay]):
        for name, item in _env(container).items():
            if credential.search(name):
                assert "value" not in item, f"{_short(workload)} sets {name} inline"
                assert "secretKeyRef" in item["valueFrom"], f"{_short(workload)} {name}"
    for config in _of_kind(objects[overlay], "ConfigMap"):
        for key in config.get("data", {}):
            assert not credential.search(key.upper()), config["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_has_a_named_grpc_port_and_a_headless_service_its_callers_dial(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    services = {s["metadata"]["name"]: s for s in _of_kind(objects[overlay], "Service")}
    for name, port in PYTHON_SERVICES.items():
        for service_name in (f"cairn-{name}", f"cairn-{name}-headless"):
            ports = {p["name"]: p["port"] for p in services[service_name]["spec"]["ports"]}
            assert ports == {"grpc": port}, service_name
        assert services[f"cairn-{name}-headless"]["spec"]["clusterIP"] == "None"
    targets = [
        (workload, name, item["value"])
        for workload, _pod, container in _containers(objects[overlay])
        for name, item in _env(container).items()
        if re.fullmatch(r"CAIRN_(GATEWAY|RETRIEVAL|MEMORY|ORCHESTRATOR)_ADDR", name)
    ]
    assert len(targets) == 4 + 1 + 3  # restproxy, memory, orchestrator
    for workload, name, value in targets:
        service = name.removeprefix("CAIRN_").removesuffix("_ADDR").lower()
        assert value == f"dns:///cairn-{service}-headless:{PYTHON_SERVICES[service]}", (
            f"{_short(workload)} {name}={value!r}"
        )
    collector = services["cairn-otel-collector"]["spec"]["ports"][0]["port"]
    for workload, _pod, container in _containers(objects[overlay]):
        if _short(workload) in SERVICES:
            endpoint = _env(container)["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"]
            assert endpoint == f"http://cairn-otel-collector:{collector}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_agent_specs_deployed_are_the_repositorys_agents(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    (agents,) = [
        c
        for c in _of_kind(objects[overlay], "ConfigMap")
        if c["metadata"]["name"].startswith("cairn-agents")
    ]
    expected = {p.name: p.read_text(encoding="utf-8") for p in (REPO / "agents").glob("*.yaml")}
    assert agents["data"] == expected


def test_postgres_is_one_instance_in_dev_and_three_synchronous_with_daily_backups_in_prod(
    objects: dict[str, list[Obj]],
) -> None:
    (dev,) = _of_kind(objects["dev"], "Cluster")
    (prod,) = _of_kind(objects["prod"], "Cluster")
    for cluster in (dev, prod):
        sql = cluster["spec"]["bootstrap"]["initdb"]["postInitApplicationSQL"]
        assert "CREATE EXTENSION IF NOT EXISTS vector" in sql
    assert dev["spec"]["instances"] == 1
    assert prod["spec"]["instances"] == 3
    assert prod["spec"]["postgresql"]["synchronous"]["number"] >= 1
    (backup,) = _of_kind(objects["prod"], "ScheduledBackup")
    assert backup["spec"]["cluster"]["name"] == prod["metadata"]["name"]
    assert _of_kind(objects["dev"], "ScheduledBackup") == []


# --- network edges --------------------------------------------------------------------------

ANYWHERE = "anywhere"
DNS = "ns:kube-system/k8s-app=kube-dns"
CNPG_OPERATOR = "ns:cnpg-system/app.kubernetes.io/name=cloudnative-pg"
VENDORS = "ip:0.0.0.0/0 except 10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,169.254.0.0/16"
TEMPO = "ns:observability/app.kubernetes.io/name=tempo"


def _pods(objs: list[Obj]) -> dict[str, dict[str, str]]:
    pods = {_short(w): dict(w["spec"]["template"]["metadata"]["labels"]) for w in _workloads(objs)}
    for cluster in _of_kind(objs, "Cluster"):
        # CloudNativePG's own instance pods, labelled by the operator.
        pods["postgres"] = {
            "cnpg.io/cluster": cluster["metadata"]["name"],
            "cnpg.io/podRole": "instance",
        }
    return pods


def _matching(selector: Obj, pods: dict[str, dict[str, str]]) -> set[str]:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are read here"
    wanted = selector.get("matchLabels", {}).items()
    return {name for name, labels in pods.items() if wanted <= labels.items()}


def _peers(peers: list[Obj] | None, pods: dict[str, dict[str, str]]) -> set[str]:
    if not peers:
        return {ANYWHERE}
    out: set[str] = set()
    for peer in peers:
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            out.add(
                f"ip:{block['cidr']}"
                + (f" except {','.join(block['except'])}" if block.get("except") else "")
            )
        elif "namespaceSelector" in peer:
            namespace = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            labels = ",".join(f"{k}={v}" for k, v in peer["podSelector"]["matchLabels"].items())
            out.add(f"ns:{namespace}/{labels}")
        else:
            out |= _matching(peer["podSelector"], pods)
    return out


def _ports(rule: Obj) -> set[str]:
    return {f"{p.get('protocol', 'TCP')}/{p['port']}" for p in rule.get("ports", [])} or {"any"}


def _edges(objs: list[Obj]) -> set[tuple[str, str, str]]:
    """(from, to, protocol/port) that both ends' policies allow: egress of the sender
    and ingress of the receiver for pods of the namespace; one side for the outside."""
    pods = _pods(objs)
    egress: set[tuple[str, str, str]] = set()
    ingress: set[tuple[str, str, str]] = set()
    for policy in _of_kind(objs, "NetworkPolicy"):
        selected = _matching(policy["spec"]["podSelector"], pods)
        for rule in policy["spec"].get("egress", []):
            for peer in _peers(rule.get("to"), pods):
                egress |= {(pod, peer, port) for pod in selected for port in _ports(rule)}
        for rule in policy["spec"].get("ingress", []):
            for peer in _peers(rule.get("from"), pods):
                ingress |= {(peer, pod, port) for pod in selected for port in _ports(rule)}
    edges = {e for e in egress if e[1] not in pods or e in ingress}
    edges |= {e for e in ingress if e[0] not in pods}
    return edges


def _expected_edges(overlay: str, pods: set[str]) -> set[tuple[str, str, str]]:
    app = {
        ("restproxy", "orchestrator", "TCP/50054"),
        ("restproxy", "memory", "TCP/50053"),
        ("restproxy", "retrieval", "TCP/50052"),
        ("orchestrator", "gateway", "TCP/50051"),
        ("orchestrator", "retrieval", "TCP/50052"),
        ("orchestrator", "memory", "TCP/50053"),
        # Forget reaches the orchestrator's copies of a subject's text (ForgetCopies).
        ("memory", "orchestrator", "TCP/50054"),
        ("retrieval", "qdrant", "TCP/6333"),
        ("gateway", VENDORS, "TCP/443"),
        (ANYWHERE, "restproxy", "TCP/8080"),
    }
    app |= {(service, "postgres", "TCP/5432") for service in PYTHON_SERVICES}
    app |= {(service, "otel-collector", "TCP/4317") for service in SERVICES}
    app |= {(pod, DNS, port) for pod in pods for port in ("UDP/53", "TCP/53")}
    platform = {
        ("postgres", "postgres", "TCP/5432"),
        (CNPG_OPERATOR, "postgres", "TCP/5432"),
        (CNPG_OPERATOR, "postgres", "TCP/8000"),
        ("postgres", ANYWHERE, "TCP/443"),
        ("postgres", ANYWHERE, "TCP/6443"),
        ("qdrant", "qdrant", "TCP/6335"),
    }
    if overlay == "prod":
        platform.add(("otel-collector", TEMPO, "TCP/4317"))
    return app | platform


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_denied_by_default_and_selected_by_a_policy_of_its_own(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    policies = _of_kind(objects[overlay], "NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert any(
        set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"} and not p["spec"].get("egress")
        for p in deny
    )
    pods = _pods(objects[overlay])
    own = set().union(
        *(_matching(p["spec"]["podSelector"], pods) for p in policies if p["spec"]["podSelector"])
    )
    assert own == set(pods)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_allowed_network_edges_are_exactly_the_ones_cairn_uses(
    overlay: str, objects: dict[str, list[Obj]]
) -> None:
    pods = set(_pods(objects[overlay]))
    assert pods == {*SERVICES, "otel-collector", "qdrant", "postgres"}
    assert _edges(objects[overlay]) == _expected_edges(overlay, pods)


def test_an_edge_opened_on_one_side_only_is_not_an_edge(objects: dict[str, list[Obj]]) -> None:
    objs = copy.deepcopy(objects["dev"])
    (gateway,) = [
        p for p in _of_kind(objs, "NetworkPolicy") if p["metadata"]["name"] == "cairn-gateway"
    ]
    gateway["spec"]["egress"].append(
        {
            "to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "memory"}}}],
            "ports": [{"protocol": "TCP", "port": 50053}],
        }
    )
    assert ("gateway", "memory", "TCP/50053") not in _edges(objs)
    gateway["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 9999}]})
    assert (ANYWHERE, "gateway", "TCP/9999") in _edges(objs)


# --- images -----------------------------------------------------------------------------------

HADOLINT = Path(shutil.which("hadolint", path=str(REPO / ".venv" / "bin")) or "hadolint")


def _containerfile(service: str) -> str:
    return (REPO / "services" / service / "Containerfile").read_text(encoding="utf-8")


def _hadolint(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HADOLINT, "--no-color", "--failure-threshold", "info", "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


@pytest.mark.parametrize("service", SERVICES)
def test_each_containerfile_passes_hadolint_with_no_finding_at_any_level(service: str) -> None:
    done = _hadolint(_containerfile(service))
    assert (done.returncode, done.stdout) == (0, "")


def test_hadolint_finds_an_unpinned_base_and_an_unpinned_package() -> None:
    done = _hadolint("FROM python:latest\nRUN pip install requests\n")
    assert done.returncode != 0
    assert "DL3007" in done.stdout
    assert "DL3013" in done.stdout


@pytest.mark.parametrize("service", SERVICES)
def test_each_image_is_multi_stage_on_pinned_bases_runs_as_non_root_and_exposes_its_manifest_port(
    service: str, objects: dict[str, list[Obj]]
) -> None:
    lines = [line.strip() for line in _containerfile(service).splitlines()]
    # A base may be a build argument (make images passes local bases); its default
    # is what a plain build uses, and it must be pinned too.
    defaults = dict(
        line.removeprefix("ARG ").split("=", 1)
        for line in lines
        if line.startswith("ARG ") and "=" in line
    )
    bases = [
        re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], line.split()[1])
        for line in lines
        if line.startswith("FROM ")
    ]
    assert len(bases) >= 2
    assert all(_is_pinned(base) for base in bases), bases
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) > 0
    (exposed,) = [int(line.split()[1]) for line in lines if line.startswith("EXPOSE ")]
    (workload,) = [w for w in _workloads(objects["prod"]) if _short(w) == service]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [exposed]
    runtime_user = container["securityContext"]["runAsUser"]
    assert users[-1] == f"{runtime_user}:{runtime_user}"
