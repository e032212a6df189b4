"""The compiled CPU decode kernel for tests: built once per session; a test that needs it
fails in CI (CI=true) when it cannot be built, and is skipped elsewhere."""

from __future__ import annotations

import os

import pytest

from engine.cpu_kernels import PagedDecodeOp, load_paged_decode


def compiled_decode_kernel() -> PagedDecodeOp:
    kernel = load_paged_decode()
    if kernel is None:
        message = "the compiled CPU decode kernel could not be built (see the log)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return kernel
