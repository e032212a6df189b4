"""The live tenancy setup its tests share (one per test module): two gateway processes
sharing one real (private) Redis, in front of one live engine, and two tenants with an
adapter each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.demo_model import make_demo_model, make_peft_adapter
from engine.demo_shapes import DemoModelSpec
from lora.targets import SUPPORTED_MODULES
from tests.live_servers import start_engine, start_gateway
from tests.redis_server import private_redis
from tests.tenancy_helpers import (
    ADMIN,
    Setup,
    admin,
    new_tenant,
)

UNSET_RESERVE = 64
"""--tpm-unset-output-reserve of the gateways."""


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("tenancy")
    adapters = {name: make_peft_adapter(tiny_model_dir, root / name, rank=4,
                                        target_modules=SUPPORTED_MODULES, seed=i + 1, b_scale=0.2)
                for i, name in enumerate(("a-bot", "b-bot"))}
    other_model = make_demo_model(root / "other-model", DemoModelSpec(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
        num_kv_heads=1, max_position_embeddings=256, seed=3))
    redis = private_redis(root)
    upload_dir = root / "uploads"
    engine = start_engine(tiny_model_dir, root, "--num-kv-blocks", "256", "--adapter-root",
                          str(root))
    gateways = [start_gateway(tiny_model_dir, [engine.url], root, "--admin-key", ADMIN,
                              "--redis-url", redis.url, "--state-refresh-s", "0.1",
                              "--adapter-upload-dir", str(upload_dir),
                              "--tpm-unset-output-reserve", str(UNSET_RESERVE))
                for _ in range(2)]
    try:
        for server in (engine, *gateways):
            server.wait_ready()
        yield Setup(engine, gateways, redis, adapters, upload_dir, other_model)
    finally:
        for server in (*gateways, engine):
            server.stop()
        redis.stop()


@pytest.fixture(scope="module")
def tenants(setup: Setup) -> dict[str, str]:
    keys = {"alpha": new_tenant(setup, "alpha"), "beta": new_tenant(setup, "beta")}
    for name, owner in (("a-bot", "alpha"), ("b-bot", "beta")):
        response = admin(setup, "POST", "/admin/adapters", json={
            "name": name, "path": str(setup.adapters[name]), "owner": owner})
        assert response.status_code == 201, response.text
    return keys
