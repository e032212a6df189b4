"""deploy/Dockerfile against the repository: its base images and stages, what it copies
(present in the repository and let in by Dockerfile.dockerignore), every pip install (only
the project's dependencies, pinned where a constraints file is given, torch from the PyTorch
index), the entrypoint and the non-root user the pods of every overlay run as.
"""

from __future__ import annotations

import re
import shlex
import tomllib

import pytest

from tests.deploy_manifests_helpers import (
    DEPLOY,
    OVERLAYS,
    ROOT,
    loragate_containers,
    objects,
    pod_spec,
)


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
        for workload, _ in loragate_containers(objects(overlay)):
            assert pod_spec(workload)["securityContext"]["runAsUser"] == 10001
