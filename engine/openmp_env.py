"""How long loragate's OpenMP threads spin at a barrier before they sleep.

torch's CPU build runs its ops on GNU OpenMP (libgomp). Between two parallel regions a worker
thread busy-waits for the next one, GOMP_SPINCOUNT spins (300,000 by default, a few
milliseconds), then sleeps. Spinning makes the next region start at once, which is what a
decode step of a few hundred short ops wants; but on a host whose cores other busy processes
or threads share (a load generator beside the server, a second service, the gateway's own
event loop streaming to many clients) a thread spinning at a barrier holds a core that the
sibling it waits for needs, and every step slows 2-3x.

A shorter spin keeps the first and most of the second: measured on 2 cores with the default
model (benchmarks/omp_wait_policy.py, benchmarks/RESULTS.md), 3,000 spins ran as fast as the
default on a quiet host and 1.4x faster with another process busy on one core; sleeping at
once (OMP_WAIT_POLICY=PASSIVE) is 2x faster there but 1.3x slower quiet.

libgomp reads these variables once, when it is loaded (with torch): the CLI entry points
call ``apply_spin_default`` before anything imports torch, and the engine processes they
start inherit the setting. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is left alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

SPIN_ENV = "GOMP_SPINCOUNT"
POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_SPINS = 3000


def apply_spin_default(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT to DEFAULT_SPINS in ``environ`` (default os.environ) unless the
    user chose a wait policy or a spin count; True when it was set here."""
    environ = os.environ if environ is None else environ
    if environ.get(SPIN_ENV) or environ.get(POLICY_ENV):
        return False
    environ[SPIN_ENV] = str(DEFAULT_SPINS)
    return True


def describe(environ: Mapping[str, str] | None = None) -> str:
    """How OpenMP threads wait here, for the engine's start line."""
    environ = os.environ if environ is None else environ
    chosen = [f"{name}={environ[name]}" for name in (POLICY_ENV, SPIN_ENV) if environ.get(name)]
    return "OpenMP " + (", ".join(chosen) if chosen else "waits as libgomp defaults")
