"""Render a kustomization directory offline: the subset of kustomize that deploy/kustomize uses.

`kubectl apply -k DIR` (or `kustomize build DIR`) is how a cluster gets these files; this
renderer exists so the test suite can render and validate them on a machine without
kustomize (none is installable from PyPI here). It implements only:

- ``resources``: YAML files (several documents each) and directories with a kustomization;
- ``components`` (``kind: Component``): their resources and patches applied to what the
  including kustomization has accumulated so far;
- ``namespace``: set on every object;
- ``labels``: ``pairs`` added to every object's labels, and to pod templates with
  ``includeTemplates``; ``includeSelectors: true`` is refused (not implemented);
- ``images``: ``name`` -> ``newName`` / ``newTag`` on containers' images;
- ``patches``: by ``path`` or inline ``patch``; a JSON6902 patch (a list of operations,
  ``add``/``replace``/``remove`` only) needs a ``target`` (kind and name); a strategic-merge
  patch names its target in itself (kind and metadata.name). Strategic merge follows
  Kubernetes' merge keys for the lists we patch (containers, env, volumes by name,
  volumeMounts by mountPath, container ports by containerPort); every other list is
  replaced, as for Kubernetes' atomic lists. ``$patch: delete`` on a document removes the
  object, on an item of a merged list that item.

Any other kustomization key is an error, so the YAML cannot drift onto a feature this file
would silently ignore. Usage: ``python deploy/render.py DIR`` prints the rendered YAML.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "components", "namespace", "labels",
                  "images", "patches"}
# Kubernetes' patchMergeKey of the list fields our patches touch; lists not named here are
# replaced by a patch (what strategic merge does for atomic lists such as args).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort",
              "imagePullSecrets": "name"}


class RenderError(ValueError):
    """A kustomization this renderer cannot render (or that kustomize would refuse)."""


def _kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    raise RenderError(f"{directory}: no kustomization file")


def _load_documents(path: Path) -> list[Obj]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict):
            raise RenderError(f"{path}: every document must be a mapping")
    return docs


def _key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """base with patch merged in (a new value; neither argument is changed)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for name, value in patch.items():
            if value is None:  # explicit null deletes the field, as in strategic merge
                merged.pop(name, None)
            elif name in merged:
                merged[name] = strategic_merge(merged[name], value, name)
            else:
                merged[name] = copy.deepcopy(value)
        return merged
    merge_key = MERGE_KEYS.get(field)
    if (isinstance(base, list) and isinstance(patch, list) and merge_key is not None
            and all(isinstance(item, dict) and merge_key in item for item in base + patch)):
        merged_list = copy.deepcopy(base)
        positions = {item[merge_key]: i for i, item in enumerate(merged_list)}
        for item in patch:
            if item.get("$patch") == "delete":  # strategic merge's list-item deletion
                merged_list = [m for m in merged_list if m[merge_key] != item[merge_key]]
                positions = {m[merge_key]: i for i, m in enumerate(merged_list)}
            elif item[merge_key] in positions:
                i = positions[item[merge_key]]
                merged_list[i] = strategic_merge(merged_list[i], item, "")
            else:
                merged_list.append(copy.deepcopy(item))
        return merged_list
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def json6902(obj: Obj, operations: list[Obj]) -> Obj:
    """obj after the add / replace / remove operations of a JSON patch (RFC 6902)."""
    result = copy.deepcopy(obj)
    for op in operations:
        kind = op.get("op")
        if kind not in ("add", "replace", "remove"):
            raise RenderError(f"JSON6902 op {kind!r} is not implemented")
        *parents, last = _pointer(op["path"])
        node: Any = result
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                node[index] = copy.deepcopy(op["value"])
            else:
                del node[index]
        elif kind == "remove":
            del node[last]
        else:
            if kind == "replace" and last not in node:
                raise RenderError(f"JSON6902 replace: {op['path']} does not exist")
            node[last] = copy.deepcopy(op["value"])
    return result


def _apply_patches(objects: list[Obj], patches: list[Obj], directory: Path) -> list[Obj]:
    for entry in patches:
        if "path" in entry:
            docs = _load_documents(directory / entry["path"])
            raw: Any = docs if not (len(docs) == 1 and isinstance(docs[0], list)) else docs[0]
        else:
            raw = yaml.safe_load(entry["patch"])
        if isinstance(raw, dict):
            raw = [raw]
        target = entry.get("target")
        if raw and all(isinstance(d, dict) and "op" in d for d in raw):
            if not target or "kind" not in target or "name" not in target:
                raise RenderError(f"{directory}: a JSON6902 patch needs target kind and name")
            wanted = (target["kind"], target["name"])
            if wanted not in {_key(o) for o in objects}:
                raise RenderError(f"{directory}: patch target {wanted} not found")
            objects = [json6902(o, raw) if _key(o) == wanted else o for o in objects]
            continue
        if target:
            raise RenderError(f"{directory}: strategic-merge patches name their own target")
        for doc in raw:
            wanted = _key(doc)
            if wanted not in {_key(o) for o in objects}:
                raise RenderError(f"{directory}: patch target {wanted} not found")
            if doc.get("$patch") == "delete":
                objects = [o for o in objects if _key(o) != wanted]
            else:
                objects = [strategic_merge(o, doc) if _key(o) == wanted else o
                           for o in objects]
    return objects


def _set_labels(objects: list[Obj], rules: list[Obj]) -> None:
    for rule in rules:
        if rule.get("includeSelectors"):
            raise RenderError("labels.includeSelectors: true is not implemented")
        pairs = rule.get("pairs", {})
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(pairs)
            template = obj.get("spec", {}).get("template")
            if rule.get("includeTemplates") and isinstance(template, dict):
                template.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def _containers(obj: Obj) -> list[Obj]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def _set_images(objects: list[Obj], images: list[Obj]) -> None:
    for obj in objects:
        for container in _containers(obj):
            image = container.get("image", "")
            # The name is everything before a digest or a tag (a ':' after the last '/').
            name = image.split("@")[0]
            if ":" in name.rsplit("/", 1)[-1]:
                name = name.rsplit(":", 1)[0]
            for rule in images:
                if rule["name"] == name:
                    new_name = rule.get("newName", name)
                    tag = rule.get("newTag")
                    container["image"] = f"{new_name}:{tag}" if tag else new_name


def render(directory: Path | str) -> list[Obj]:
    """The objects kustomize would build from the kustomization in directory."""
    directory = Path(directory)
    spec = yaml.safe_load(_kustomization_file(directory).read_text()) or {}
    unknown = set(spec) - SUPPORTED_KEYS
    if unknown:
        raise RenderError(f"{directory}: kustomization keys not implemented: "
                          f"{', '.join(sorted(unknown))}")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise RenderError(f"{directory}: a component is included with components:, "
                          f"not resources:")
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else _load_documents(path)
    for entry in spec.get("components", []):
        objects = _apply_component(objects, directory / entry)
    seen: set[tuple[str, str]] = set()
    for obj in objects:
        if _key(obj) in seen:  # kustomize refuses the same object twice
            raise RenderError(f"{directory}: {_key(obj)} defined twice")
        seen.add(_key(obj))
    objects = _apply_patches(objects, spec.get("patches", []), directory)
    _set_labels(objects, spec.get("labels", []))
    _set_images(objects, spec.get("images", []))
    if "namespace" in spec:
        for obj in objects:
            obj["metadata"]["namespace"] = spec["namespace"]
    return objects


def _apply_component(objects: list[Obj], directory: Path) -> list[Obj]:
    """A component's own resources join objects, then its transformations apply to all."""
    spec = yaml.safe_load(_kustomization_file(directory).read_text()) or {}
    if spec.get("kind") != "Component":
        raise RenderError(f"{directory}: a component must have kind: Component")
    unknown = set(spec) - (SUPPORTED_KEYS - {"components", "namespace"})
    if unknown:
        raise RenderError(f"{directory}: kustomization keys not implemented: "
                          f"{', '.join(sorted(unknown))}")
    for entry in spec.get("resources", []):
        path = directory / entry
        objects = objects + (render(path) if path.is_dir() else _load_documents(path))
    objects = _apply_patches(objects, spec.get("patches", []), directory)
    _set_labels(objects, spec.get("labels", []))
    _set_images(objects, spec.get("images", []))
    return objects


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/render.py KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    try:
        objects = render(argv[0])
    except (RenderError, OSError, KeyError) as exc:
        print(f"render: error: {exc}", file=sys.stderr)
        return 1
    print(yaml.safe_dump_all(objects, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
