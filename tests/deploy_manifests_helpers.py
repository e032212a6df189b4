"""Shared by the tests of deploy/ (test_deploy_*.py): the overlays rendered by deploy/render.py
(the kustomize subset those files use), fresh copies of their objects, and the small lookups
the checks share (a named object, a workload's pod spec and containers, the loragate
containers, a container's environment).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "kustomize" / "overlays").iterdir() if p.is_dir())

LORAGATE_IMAGE = "ghcr.io/example/loragate"
WORKLOADS = ("Deployment", "StatefulSet")

Obj = dict[str, Any]


def load_renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["deploy_render"] = module
    spec.loader.exec_module(module)
    return module


render = load_renderer()


@functools.cache
def rendered(overlay: str) -> tuple[Obj, ...]:
    return tuple(render.render(DEPLOY / "kustomize" / "overlays" / overlay))


def objects(overlay: str) -> list[Obj]:
    """A fresh copy of the overlay's objects (tests may not share mutations)."""
    return copy.deepcopy(list(rendered(overlay)))


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert found, f"{kind}/{name} not rendered"
    return found[0]


def pod_spec(obj: Obj) -> Obj:
    spec: Obj = obj["spec"]["template"]["spec"]
    return spec


def containers(obj: Obj) -> list[Obj]:
    pod = pod_spec(obj)
    return [*pod.get("initContainers", []), *pod["containers"]]


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in WORKLOADS)


def loragate_containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for workload in workloads(objs):
        for container in containers(workload):
            if container["image"].split(":")[0] == LORAGATE_IMAGE:
                yield workload, container


def container_env(container: Obj, objs: list[Obj]) -> dict[str, str | None]:
    """The container's variables: literal values, None for those from Secrets / fields."""
    env: dict[str, str | None] = {}
    for env_from in container.get("envFrom", []):
        name = env_from.get("configMapRef", {}).get("name")
        if name:
            env.update(find(objs, "ConfigMap", name).get("data", {}))
    for item in container.get("env", []):
        env[item["name"]] = item.get("value")
    return env
