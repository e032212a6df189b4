"""loragate's own processes spin GOMP_SPINCOUNT=3000 times at an OpenMP barrier unless the
user chose a wait policy or a spin count; libgomp reads the setting when torch loads it,
so the CLI modules that set it must not import torch themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.openmp_env import DEFAULT_SPINS, apply_spin_default, describe


def test_the_spin_count_is_set_only_where_the_user_set_nothing() -> None:
    empty: dict[str, str] = {}
    assert apply_spin_default(empty) and empty == {"GOMP_SPINCOUNT": str(DEFAULT_SPINS)}
    for chosen in ({"GOMP_SPINCOUNT": "INFINITE"}, {"OMP_WAIT_POLICY": "PASSIVE"},
                   {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "10"}):
        environ = dict(chosen)
        assert not apply_spin_default(environ) and environ == chosen


@pytest.mark.parametrize("module", ["gateway.cli", "engine.http.cli"])
def test_the_entry_points_set_it_before_torch_is_loaded(module: str) -> None:
    """main() sets the variable first thing; importing its module must not load torch (and
    with it libgomp, which would have read its settings already)."""
    code = (f"import sys, {module}; "
            "sys.exit('torch imported' if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_engine_start_line_says_how_openmp_waits() -> None:
    assert describe({}) == "OpenMP waits as libgomp defaults"
    assert describe({"GOMP_SPINCOUNT": "3000"}) == "OpenMP GOMP_SPINCOUNT=3000"
    assert describe({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "5"}) == \
        "OpenMP OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=5"
