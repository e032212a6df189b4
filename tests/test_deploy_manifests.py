"""The Kubernetes files of deploy/: rendered offline, validated, cross-checked.

Each overlay is rendered by deploy/render.py (the kustomize subset those files use) and every
object is validated: core kinds against the Kubernetes JSON schemas that the
kubernetes-validate package ships (strict: unknown fields fail), for the oldest and newest
Kubernetes versions we support; the CRD kinds (ServiceMonitor, InferencePool) against the
schemas in deploy/schemas/. Then what no schema sees: selectors that select something,
ports that probes and Services name, Secrets / ConfigMaps / claims that exist or are
documented as user-provided, loragate args parsed by loragate's own parser, LORAGATE_*
variables that loragate reads (with values its config dataclasses accept), drain timeouts
that fit the grace periods, and the Dockerfile's pip installs against the repository.
Nothing is installed or applied; the whole module takes a few seconds (most of it importing
loragate's CLI, which imports torch).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import inspect
import json
import re
import shlex
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs the dev extra kubernetes-validate")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "kustomize" / "overlays").iterdir() if p.is_dir())
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
LORAGATE_IMAGE = "ghcr.io/example/loragate"
WORKLOADS = ("Deployment", "StatefulSet")

Obj = dict[str, Any]


def _load_renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["deploy_render"] = module
    spec.loader.exec_module(module)
    return module


render = _load_renderer()


@functools.cache
def _rendered(overlay: str) -> tuple[Obj, ...]:
    return tuple(render.render(DEPLOY / "kustomize" / "overlays" / overlay))


def objects(overlay: str) -> list[Obj]:
    """A fresh copy of the overlay's objects (tests may not share mutations)."""
    return copy.deepcopy(list(_rendered(overlay)))


def _find(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert found, f"{kind}/{name} not rendered"
    return found[0]


def _pod_spec(obj: Obj) -> Obj:
    spec: Obj = obj["spec"]["template"]["spec"]
    return spec


def _containers(obj: Obj) -> list[Obj]:
    pod = _pod_spec(obj)
    return [*pod.get("initContainers", []), *pod["containers"]]


def _workloads(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in WORKLOADS)


def _loragate_containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for workload in _workloads(objs):
        for container in _containers(workload):
            if container["image"].split(":")[0] == LORAGATE_IMAGE:
                yield workload, container


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
    engine = _find(objs, "StatefulSet", "loragate-engine")
    _containers(engine)[0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    assert schema_errors(engine, K8S_VERSIONS[0])
    engine = _find(objects("gie"), "StatefulSet", "loragate-engine")
    engine["spec"]["replicas"] = "two"
    assert schema_errors(engine, K8S_VERSIONS[0])
    pool = _find(objs, "InferencePool", "loragate")
    del pool["spec"]["endpointPickerRef"]["port"]
    assert schema_errors(pool, K8S_VERSIONS[0])
    pool = _find(objects("gie"), "InferencePool", "loragate")
    pool["spec"]["targetPortNumber"] = 8000  # the pre-v1 field
    assert schema_errors(pool, K8S_VERSIONS[0])
    monitor = _find(objects("gpu"), "ServiceMonitor", "loragate-engine")
    del monitor["spec"]["selector"]
    assert schema_errors(monitor, K8S_VERSIONS[0])


# ------------------------------------------------------------------------ cross-references
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_and_ports(overlay: str) -> None:
    objs = objects(overlay)
    pods = [(w, w["spec"]["template"]["metadata"]["labels"]) for w in _workloads(objs)]
    services = [o for o in objs if o["kind"] == "Service"]
    for workload in _workloads(objs):
        assert _selects(workload["spec"]["selector"]["matchLabels"],
                        workload["spec"]["template"]["metadata"]["labels"])
        if workload["kind"] == "StatefulSet":
            _find(objs, "Service", workload["spec"]["serviceName"])
        for container in _containers(workload):
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
                names = {p.get("name") for c in _containers(workload)
                         for p in c.get("ports", [])}
                numbers = {p["containerPort"] for c in _containers(workload)
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
            numbers = {p["containerPort"] for c in _containers(workload)
                       for p in c.get("ports", [])}
            assert {p["number"] for p in pool["spec"]["targetPorts"]} <= numbers
    for hpa in (o for o in objs if o["kind"] == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        _find(objs, target["kind"], target["name"])


def _references(objs: list[Obj]) -> Iterator[tuple[str, str, str | None]]:
    """(kind, name, key or None) of every Secret, ConfigMap and claim the objects use."""
    for workload in _workloads(objs):
        for volume in _pod_spec(workload).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                yield "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], None
            if "secret" in volume:
                yield "Secret", volume["secret"]["secretName"], None
            if "configMap" in volume:
                yield "ConfigMap", volume["configMap"]["name"], None
        for container in _containers(workload):
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


# ------------------------------------------------------------------- loragate's own options
@functools.cache
def _parser() -> argparse.ArgumentParser:
    from gateway.cli import build_parser

    return build_parser()


@functools.cache
def known_env() -> frozenset[str]:
    """Every LORAGATE_* variable loragate reads: one per config field (engine/config_args.py)
    and the few read directly (string literals in the packages' sources)."""
    from engine.config import EngineConfig
    from engine.config_args import ENV_PREFIX
    from gateway.config import GatewayConfig

    names = {ENV_PREFIX + f.name.upper()
             for cls in (EngineConfig, GatewayConfig) for f in dataclasses.fields(cls)}
    for package in ("engine", "gateway", "lora", "prefix_cache"):
        for source in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"[\"'](LORAGATE_[A-Z0-9_]+)[\"']", source.read_text()))
    return frozenset(names)


def _env(container: Obj, objs: list[Obj]) -> dict[str, str | None]:
    """The container's variables: literal values, None for those from Secrets / fields."""
    env: dict[str, str | None] = {}
    for env_from in container.get("envFrom", []):
        name = env_from.get("configMapRef", {}).get("name")
        if name:
            env.update(_find(objs, "ConfigMap", name).get("data", {}))
    for item in container.get("env", []):
        env[item["name"]] = item.get("value")
    return env


def _expand(text: str, env: dict[str, str | None]) -> str:
    """$(VAR) as the kubelet expands it; a value it cannot know becomes a placeholder."""
    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) names no variable of the container"
        return env[match.group(1)] or f"placeholder-{match.group(1).lower()}"
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, text)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_loragate_args_and_env(overlay: str) -> None:
    from engine.config import EngineConfig
    from engine.config_args import build_config
    from gateway.config import GatewayConfig

    objs = objects(overlay)
    checked = 0
    for workload, container in _loragate_containers(objs):
        env = _env(container, objs)
        where = f"{overlay}: {workload['metadata']['name']}/{container['name']}"
        args = [_expand(a, env) for a in container["args"]]
        try:
            parsed = _parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{where}: loragate refuses its args {args}")
        assert parsed.command in ("serve", "engine"), where
        mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
        for path in [parsed.model, *parsed.adapter_root]:
            assert any(path.startswith(m + "/") or path == m for m in mounts), (where, path)
        unknown = {n for n in env if n.startswith("LORAGATE_")} - known_env()
        assert not unknown, f"{where}: loragate reads no {sorted(unknown)}"
        # Helper variables must be used: each feeds an argument.
        joined = " ".join(container["args"])
        for name in env:
            if not name.startswith("LORAGATE_"):
                assert f"$({name})" in joined, f"{where}: {name} is set but not used"
        # The values must be ones the config dataclasses accept (as `loragate` would).
        literal = {k: v for k, v in env.items() if v is not None}
        model = parsed.model
        build_config(EngineConfig, argparse.Namespace(), {}, env=literal, model=model)
        if parsed.command == "serve":
            build_config(GatewayConfig, argparse.Namespace(), {}, env=literal)
            # What `serve` refuses at start-up beyond loopback / without engines.
            assert "LORAGATE_ADMIN_KEY" in env, f"{where}: no admin key on a public address"
            assert parsed.instances >= 1 or "LORAGATE_REDIS_URL" in env, where
        else:
            assert "LORAGATE_ENGINE_TOKEN" in env, f"{where}: engines need a token"
        checked += 1
    assert checked


def _prestop_seconds(container: Obj) -> int:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    return int(command[1]) if command and command[0] == "sleep" else 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_the_drain(overlay: str) -> None:
    """SIGTERM drains (in-flight streams finish): the kubelet must wait for the preStop
    sleep plus the drain before it kills the process."""
    from engine.http.server import serve
    from gateway.config import GatewayConfig

    engine_drain = inspect.signature(serve).parameters["drain_timeout_s"].default
    objs = objects(overlay)
    for workload, container in _loragate_containers(objs):
        env = _env(container, objs)
        command = container["args"][0]
        drain = float(env.get("LORAGATE_DRAIN_TIMEOUT_S") or GatewayConfig.drain_timeout_s) \
            if command == "serve" else float(engine_drain)
        grace = _pod_spec(workload).get("terminationGracePeriodSeconds", 30)
        assert grace >= _prestop_seconds(container) + drain + 5, workload["metadata"]["name"]
        assert "readinessProbe" in container and "livenessProbe" in container


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_namespace(overlay: str) -> None:
    """Every object lands in the overlay's namespace (one left without would go to
    kubectl's current namespace, away from the Secrets it uses)."""
    assert {o["metadata"].get("namespace") for o in objects(overlay)} == {"loragate"}


def test_overlays_pick_their_image_and_device() -> None:
    for overlay, tag, device in (("cpu", "cpu", "cpu"), ("gpu", "cuda", "cuda")):
        objs = objects(overlay)
        engine = _find(objs, "StatefulSet", "loragate-engine")
        container = _containers(engine)[0]
        assert container["image"] == f"{LORAGATE_IMAGE}:{tag}"
        assert _env(container, objs)["LORAGATE_DEVICE"] == device
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


# ------------------------------------------------------------------------------ Dockerfile
def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    steps = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            steps.append((instruction.upper(), rest.strip()))
    return steps


def test_dockerfile_installs_what_the_repository_has() -> None:
    steps = _dockerfile()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dependencies = {re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in project["dependencies"]}
    args = {}
    for instruction, rest in steps:
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            if default:  # a bare ARG in a stage only brings the global one into scope
                args[name] = default
    stages = [rest.split()[-1] for instruction, rest in steps if instruction == "FROM"]
    assert {"cpu", "cuda"} <= set(stages)
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_IMAGE"]
    # What the src stage copies (repository path -> image path) and the ignore file lets in.
    allowed = {line[1:] for line in (DEPLOY / "Dockerfile.dockerignore").read_text().split()
               if line.startswith("!")}
    copied: dict[str, str] = {}
    for instruction, rest in steps:
        if instruction == "COPY" and not rest.startswith("--from"):
            *sources, dest = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert source in allowed, f"COPY {source}: excluded by the dockerignore"
                image_path = dest.rstrip("/") + "/" + source if dest.endswith("/") else dest
                copied[image_path.replace("/src", "/opt/loragate", 1)] = source
    installs = 0
    for instruction, rest in steps:
        if instruction != "RUN":
            continue
        for command in rest.split("&&"):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            installs += 1
            words = words[2:]
            constraints = None
            while words:
                word = words.pop(0)
                if word in ("-c", "--constraint"):
                    constraints = words.pop(0)
                    assert constraints in copied, f"{constraints}: not copied into the image"
                elif word in ("--index-url", "--extra-index-url"):
                    url = words.pop(0)
                    var = re.fullmatch(r"\$\{(\w+)\}", url)
                    assert var and args.get(var.group(1), "").startswith(
                        "https://download.pytorch.org/whl/"), url
                elif word.startswith("-"):
                    pytest.fail(f"pip install {word}: an option this lint does not know")
                elif word == "/opt/loragate":
                    assert "pyproject.toml" in copied.values()
                    assert all(p.split("*")[0].rstrip(".") in copied.values() for p in
                               ("engine*", "lora*", "prefix_cache*", "gateway*"))
                else:
                    assert word.lower() in dependencies, f"pip install {word}: not a dependency"
                    if constraints is not None:
                        pinned = (ROOT / copied[constraints]).read_text()
                        assert re.search(rf"^{word}==", pinned, re.M), (word, constraints)
    assert installs == 4
    finals = [i for i, (instruction, rest) in enumerate(steps) if instruction == "FROM"
              and rest.split()[-1] in ("cpu", "cuda")]
    for start, end in zip(finals, [*finals[1:], len(steps)], strict=True):
        stage = steps[start:end]
        assert ("ENTRYPOINT", '["loragate"]') in stage
        users = [rest for instruction, rest in stage if instruction == "USER"]
        assert users and users[-1].split(":")[0] == "10001"
    assert project["scripts"]["loragate"]
    # The pods run as the image's user.
    for overlay in OVERLAYS:
        for workload, _ in _loragate_containers(objects(overlay)):
            assert _pod_spec(workload)["securityContext"]["runAsUser"] == 10001
