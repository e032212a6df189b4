"""Schemathesis against the live gateway's own OpenAPI schema: generated requests for every
operation (OpenAI routes and the admin API, as the operator) must never get a 5xx.

The engine runs with a small context (max_model_len 128), so generated max_tokens values
are either refused (400) or finish quickly. FUZZ_EXAMPLES cases per operation here; the
reliability benchmark runs thousands.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.live_servers import LiveServer, start_engine, start_gateway

ADMIN = "fuzz-admin"
FUZZ_EXAMPLES = 25


@pytest.fixture(scope="module")
def fuzz_gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("fuzz")
    engine = start_engine(tiny_model_dir, root, "--num-kv-blocks", "64", "--max-model-len",
                          "128")
    gateway = start_gateway(tiny_model_dir, [engine.url], root, "--admin-key", ADMIN,
                            "--adapter-upload-dir", str(root / "uploads"))
    try:
        engine.wait_ready()
        gateway.wait_ready()
        yield gateway
    finally:
        gateway.stop()
        engine.stop()


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_gateway: LiveServer) -> Any:
    return schemathesis.openapi.from_url(fuzz_gateway.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@schema.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(case: Any) -> None:
    response = case.call(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
