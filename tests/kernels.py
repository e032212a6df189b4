"""The compiled CPU kernels for tests: built once per session; a test that needs them fails
in CI (CI=true) when they cannot be built, and is skipped elsewhere."""

from __future__ import annotations

import os
from typing import TypeVar

import pytest

from engine.cpu_kernels import FusedOps, PagedDecodeOp, load_fused_ops, load_paged_decode

T = TypeVar("T")


def required(built: T | None) -> T:
    """built, or the test fails in CI / is skipped elsewhere when it is None."""
    if built is None:
        message = "the compiled CPU kernels could not be built (see the log)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return built


def compiled_decode_kernel() -> PagedDecodeOp:
    return required(load_paged_decode())


def compiled_fused_ops() -> FusedOps:
    return required(load_fused_ops())
