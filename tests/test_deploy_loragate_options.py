"""loragate's own options in the deploy/ overlays: every loragate container's args parse
with loragate's own parser (after the kubelet's $(VAR) expansion) and name mounted paths,
its LORAGATE_* variables are ones loragate reads, with values its config dataclasses accept,
what `serve` and `engine` refuse at start-up is set, and the termination grace periods cover
the preStop sleep plus the drain. Imports loragate's CLI (and so torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re

import pytest

from tests.deploy_manifests_helpers import (
    OVERLAYS,
    ROOT,
    Obj,
    container_env,
    loragate_containers,
    objects,
    pod_spec,
)


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
    for workload, container in loragate_containers(objs):
        env = container_env(container, objs)
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
    for workload, container in loragate_containers(objs):
        env = container_env(container, objs)
        command = container["args"][0]
        drain = float(env.get("LORAGATE_DRAIN_TIMEOUT_S") or GatewayConfig.drain_timeout_s) \
            if command == "serve" else float(engine_drain)
        grace = pod_spec(workload).get("terminationGracePeriodSeconds", 30)
        assert grace >= _prestop_seconds(container) + drain + 5, workload["metadata"]["name"]
        assert "readinessProbe" in container and "livenessProbe" in container
