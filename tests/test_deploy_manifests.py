"""The Kubernetes files of deploy/: rendered offline, validated, cross-checked.

Each overlay is rendered by deploy/render.py (the kustomize subset those files use) and every
object is validated: core kinds against the Kubernetes JSON schemas that the
kubernetes-validate package ships (strict: unknown fields fail), for the oldest and newest
Kubernetes versions we support; the CRD kinds (ServiceMonitor, InferencePool) against the
schemas in deploy/schemas/. Then what no schema sees: selectors that select something,
ports that probes and Services name, Secrets / ConfigMaps / claims that exist or are
documented as user-provided, one namespace, each overlay's image and device; and the
renderer itself against what kustomize does. loragate's args and variables are checked in
test_deploy_loragate_options.py, the Dockerfile in test_deploy_dockerfile.py. Nothing is
installed or applied.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.deploy_manifests_helpers import (
    DEPLOY,
    LORAGATE_IMAGE,
    OVERLAYS,
    Obj,
    container_env,
    containers,
    find,
    objects,
    pod_spec,
    render,
    workloads,
)

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs the dev extra kubernetes-validate")

# The oldest and newest minor versions the manifests are meant for: a field removed or added
# between them fails one of the two.
K8S_VERSIONS = ("1.30", "1.34")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-inference-v1.json",
}
# Created by the user (deploy/README.md says what each must hold), never rendered: Secrets
# hold credentials, claims depend on the cluster's storage classes.
USER_PROVIDED = {
    ("Secret", "loragate-engine-token"): {"token"},
    ("Secret", "loragate-admin"): {"admin-key", "metrics-token"},
    ("Secret", "loragate-redis"): {"password", "url"},
    ("PersistentVolumeClaim", "loragate-models"): set(),
    ("PersistentVolumeClaim", "loragate-adapters"): set(),
}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ------------------------------------------------------------------------ schema validation
def schema_errors(obj: Obj, version: str) -> list[str]:
    """Every schema error of obj (empty when it validates)."""
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd is not None:
        schema = json.loads((DEPLOY / "schemas" / crd).read_text())
        validator = jsonschema.Draft202012Validator(schema)
        return [f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in validator.iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{where} (k8s {version}): {'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{where}: no schema: {exc.message}"]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates(overlay: str, version: str) -> None:
    objs = objects(overlay)
    assert objs
    errors = [e for obj in objs for e in schema_errors(obj, version)]
    assert not errors, "\n".join(errors)


def test_validation_catches_mistakes() -> None:
    """The validators are not vacuous: a misspelt field, a wrong type and a missing required
    field each fail, for a core kind and for both CRD schemas."""
    objs = objects("gie")
    engine = find(objs, "StatefulSet", "loragate-engine")
    containers(engine)[0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    assert schema_errors(engine, K8S_VERSIONS[0])
    engine = find(objects("gie"), "StatefulSet", "loragate-engine")
    engine["spec"]["replicas"] = "two"
    assert schema_errors(engine, K8S_VERSIONS[0])
    pool = find(objs, "InferencePool", "loragate")
    del pool["spec"]["endpointPickerRef"]["port"]
    assert schema_errors(pool, K8S_VERSIONS[0])
    pool = find(objects("gie"), "InferencePool", "loragate")
    pool["spec"]["targetPortNumber"] = 8000  # the pre-v1 field
    assert schema_errors(pool, K8S_VERSIONS[0])
    monitor = find(objects("gpu"), "ServiceMonitor", "loragate-engine")
    del monitor["spec"]["selector"]
    assert schema_errors(monitor, K8S_VERSIONS[0])


# ------------------------------------------------------------------------ cross-references
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_and_ports(overlay: str) -> None:
    objs = objects(overlay)
    pods = [(w, w["spec"]["template"]["metadata"]["labels"]) for w in workloads(objs)]
    services = [o for o in objs if o["kind"] == "Service"]
    for workload in workloads(objs):
        assert _selects(workload["spec"]["selector"]["matchLabels"],
                        workload["spec"]["template"]["metadata"]["labels"])
        if workload["kind"] == "StatefulSet":
            find(objs, "Service", workload["spec"]["serviceName"])
        for container in containers(workload):
            ports = {p.get("name") for p in container.get("ports", [])} | {
                p["containerPort"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                handler = container.get(probe, {})
                for kind in ("httpGet", "tcpSocket"):
                    if kind in handler:
                        assert handler[kind]["port"] in ports, (container["name"], probe)
    for service in services:
        selected = [w for w, labels in pods if _selects(service["spec"]["selector"], labels)]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for workload in selected:
                names = {p.get("name") for c in containers(workload)
                         for p in c.get("ports", [])}
                numbers = {p["containerPort"] for c in containers(workload)
                           for p in c.get("ports", [])}
                assert port["targetPort"] in names | numbers, service["metadata"]["name"]
    for monitor in (o for o in objs if o["kind"] == "ServiceMonitor"):
        matching = [s for s in services
                    if _selects(monitor["spec"]["selector"]["matchLabels"],
                                s["metadata"].get("labels", {}))]
        assert matching, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            assert all(endpoint["port"] in {p.get("name") for p in s["spec"]["ports"]}
                       for s in matching)
    for pool in (o for o in objs if o["kind"] == "InferencePool"):
        members = [w for w, labels in pods
                   if _selects(pool["spec"]["selector"]["matchLabels"], labels)]
        assert members, "the InferencePool selects no pod"
        for workload in members:
            numbers = {p["containerPort"] for c in containers(workload)
                       for p in c.get("ports", [])}
            assert {p["number"] for p in pool["spec"]["targetPorts"]} <= numbers
    for hpa in (o for o in objs if o["kind"] == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        find(objs, target["kind"], target["name"])


def _references(objs: list[Obj]) -> Iterator[tuple[str, str, str | None]]:
    """(kind, name, key or None) of every Secret, ConfigMap and claim the objects use."""
    for workload in workloads(objs):
        for volume in pod_spec(workload).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                yield "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], None
            if "secret" in volume:
                yield "Secret", volume["secret"]["secretName"], None
            if "configMap" in volume:
                yield "ConfigMap", volume["configMap"]["name"], None
        for container in containers(workload):
            for env in container.get("env", []):
                source = env.get("valueFrom", {})
                if "secretKeyRef" in source:
                    yield "Secret", source["secretKeyRef"]["name"], source["secretKeyRef"]["key"]
                if "configMapKeyRef" in source:
                    ref = source["configMapKeyRef"]
                    yield "ConfigMap", ref["name"], ref["key"]
            for env_from in container.get("envFrom", []):
                if "configMapRef" in env_from:
                    yield "ConfigMap", env_from["configMapRef"]["name"], None
                if "secretRef" in env_from:
                    yield "Secret", env_from["secretRef"]["name"], None
    for monitor in (o for o in objs if o["kind"] == "ServiceMonitor"):
        for endpoint in monitor["spec"]["endpoints"]:
            credentials = endpoint.get("authorization", {}).get("credentials")
            if credentials:
                yield "Secret", credentials["name"], credentials["key"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_referenced_configs_exist_or_are_documented(overlay: str) -> None:
    objs = objects(overlay)
    readme = (DEPLOY / "README.md").read_text()
    for kind, name, key in _references(objs):
        rendered = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
        if rendered:
            assert key is None or key in rendered[0].get("data", {}), (kind, name, key)
            continue
        assert (kind, name) in USER_PROVIDED, f"{kind}/{name} is neither rendered nor " \
                                              f"documented as user-provided"
        assert key is None or key in USER_PROVIDED[(kind, name)], (kind, name, key)
        assert f"`{name}`" in readme, f"deploy/README.md does not document {name}"
        for documented_key in USER_PROVIDED[(kind, name)]:
            assert f"`{documented_key}`" in readme, f"deploy/README.md: {name}.{documented_key}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_namespace(overlay: str) -> None:
    """Every object lands in the overlay's namespace (one left without would go to
    kubectl's current namespace, away from the Secrets it uses)."""
    assert {o["metadata"].get("namespace") for o in objects(overlay)} == {"loragate"}


def test_overlays_pick_their_image_and_device() -> None:
    for overlay, tag, device in (("cpu", "cpu", "cpu"), ("gpu", "cuda", "cuda")):
        objs = objects(overlay)
        engine = find(objs, "StatefulSet", "loragate-engine")
        container = containers(engine)[0]
        assert container["image"] == f"{LORAGATE_IMAGE}:{tag}"
        assert container_env(container, objs)["LORAGATE_DEVICE"] == device
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == 1) == (overlay == "gpu")
    assert {o["kind"] for o in objects("cpu")}.isdisjoint({"ServiceMonitor", "InferencePool"})
    assert not [o for o in objects("gie") if o["metadata"]["name"] == "loragate-gateway"]


def test_renderer_merges_as_strategic_merge_does() -> None:
    base = {"containers": [{"name": "a", "image": "x", "args": ["1", "2"],
                            "env": [{"name": "K", "value": "1"}, {"name": "L", "value": "2"}],
                            "ports": [{"name": "http", "containerPort": 1}]}]}
    patch = {"containers": [{"name": "a", "args": ["3"],
                             "env": [{"name": "L", "$patch": "delete"},
                                     {"name": "M", "value": "3"}],
                             "ports": [{"name": "http", "containerPort": 2}]}]}
    merged = render.strategic_merge(base, patch)["containers"]
    assert len(merged) == 1 and merged[0]["image"] == "x"
    assert merged[0]["args"] == ["3"]  # atomic lists are replaced
    assert [e["name"] for e in merged[0]["env"]] == ["K", "M"]
    # Ports merge by containerPort: a new number is a second port, as kustomize makes it.
    assert [p["containerPort"] for p in merged[0]["ports"]] == [1, 2]
    assert render.json6902(base, [{"op": "replace", "value": 2,
                                   "path": "/containers/0/ports/0/containerPort"}]
                           )["containers"][0]["ports"] == [{"name": "http", "containerPort": 2}]


def test_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nreplicas: []\n")
    with pytest.raises(render.RenderError, match="replicas"):
        render.render(tmp_path)
