"""The compiled CPU kernels built for AVX2 (no AVX-512), whatever this machine has: their
vector code differs by target (vec_math.h), so an AVX-512 host's own build would leave the
AVX2 paths untested. The kernels' own suites run in a subprocess with LORAGATE_CPU_MARCH=
haswell, against the same torch oracles."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu_kernels import MARCH_ENV

ROOT = Path(__file__).resolve().parents[1]
SUITES = ["tests/test_cascade_spans.py", "tests/test_paged_decode.py",
          "tests/test_fused_elementwise.py"]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 target")
def test_the_avx2_build_matches_the_oracles() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    words = set(flags.split())
    if "avx2" not in words:
        pytest.skip("this machine cannot run AVX2 code")
    if "avx512f" not in words:
        # -march=native is an AVX2 target here: the suites below already ran on it.
        pytest.skip("this machine's own build is the AVX2 build, tested by those suites")
    env = {**os.environ, MARCH_ENV: "haswell", "CI": "true"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *SUITES], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
