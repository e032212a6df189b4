"""Schemathesis against the live gateway's own OpenAPI schema: generated requests for every
operation (OpenAI routes and the admin API, as the operator) must never get a 5xx.

The engine runs with a small context (max_model_len 128), so generated max_tokens values
are either refused (400) or finish quickly. FUZZ_EXAMPLES cases per operation here; the
reliability benchmark runs thousands.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.live_servers import LiveServer, start_engine, start_gateway

ADMIN = "fuzz-admin"
FUZZ_EXAMPLES = int(os.environ.get("LORAGATE_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzz_gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("fuzz")
    engine = start_engine(tiny_model_dir, root, "--num-kv-blocks", "64", "--max-model-len",
                          "128", "--adapter-root", str(root / "uploads"))
    gateway = start_gateway(tiny_model_dir, [engine.url], root, "--admin-key", ADMIN,
                            "--adapter-upload-dir", str(root / "uploads"))
    try:
        engine.wait_ready()
        gateway.wait_ready()
        yield gateway
    finally:
        gateway.stop()
        engine.stop()


def test_no_generated_request_gets_a_5xx(fuzz_gateway: LiveServer) -> None:
    """Every operation of the schema, FUZZ_EXAMPLES generated cases each (schemathesis
    strategies driven by hypothesis directly: its pytest plugin lags pytest 9)."""
    schema = schemathesis.openapi.from_url(fuzz_gateway.url + "/openapi.json")
    failures: list[str] = []
    statuses: list[int] = []
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 20

    for operation in operations:
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            response = case.call(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
            statuses.append(response.status_code)
            if response.status_code >= 500:
                failures.append(f"{case.as_curl_command()} -> {response.status_code} "
                                f"{response.text[:300]}")

        check()
    assert failures == []
    assert len(statuses) >= 10 * len(operations)  # the cases really ran
    assert {200, 400, 404} <= set(statuses)
