"""Create (or reuse) the venv that holds lm-evaluation-harness, the client of the lm-eval check.

    python -m benchmarks.clients.setup_lm_eval [--venv PATH]

lm-eval lives in its own venv, not in loragate's: it pins its own ranges of transformers,
datasets and friends, and the check must exercise the server exactly as an outside user's
lm-eval would. Installed: ``lm-eval[api]==0.4.9`` (the ``api`` extra brings the HTTP client
of its ``local-completions`` model) with ``torch==2.13.0`` pinned by a constraint, because
lm-eval depends on torch and an unpinned one would pull the multi-GB CUDA wheels; the pinned
version is the CPU build this machine's pip finds locally (see constraints-cpu.txt). lm-eval
only needs a tokenizer from its transformers, so its version may differ from loragate's; it
is capped below 5, whose import of lm-eval 0.4.9's model registry fails (a removed class).

An existing venv whose python imports lm_eval at the wanted version is reused as it is. The
default place is $LORAGATE_LM_EVAL_VENV, else .clients/lm-eval-venv in the repository.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.peers.setup_venv import run_plan

LM_EVAL_VERSION = "0.4.9"
PACKAGE = f"lm-eval[api]=={LM_EVAL_VERSION}"
CONSTRAINTS = ("torch==2.13.0",  # the local CPU build, not the CUDA wheels
               # lm-eval 0.4.9 imports AutoModelForVision2Seq, gone in 5; the floor keeps
               # pip from backtracking to releases whose tokenizers only build from source
               "transformers>=4.51,<5")
VENV_ENV = "LORAGATE_LM_EVAL_VENV"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = Path(os.environ.get(VENV_ENV) or REPO_ROOT / ".clients" / "lm-eval-venv")
"""$LORAGATE_LM_EVAL_VENV, else .clients/lm-eval-venv in the repository (git-ignored)."""


def installed_version(venv: Path) -> str | None:
    """lm_eval's distribution version as the venv's python sees it, provided lm_eval imports;
    None otherwise."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    code = ("import sys, lm_eval, importlib.metadata as m; "
            "sys.stdout.write(m.version('lm_eval'))")
    probe = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                           check=False)
    return probe.stdout.strip() if probe.returncode == 0 else None


def install_plan(venv: Path, constraints: Path) -> list[list[str]]:
    """The commands that turn an empty ``venv`` path into a working lm-eval venv."""
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    return [[sys.executable, "-m", "venv", str(venv)],
            [*pip, "install", "--upgrade", "pip"],
            [*pip, "install", "-c", str(constraints), PACKAGE]]


def ensure_venv(venv: Path = DEFAULT_VENV) -> Path:
    """The venv path, after creating it if it does not already hold lm-eval LM_EVAL_VERSION."""
    found = installed_version(venv)
    if found == LM_EVAL_VERSION:
        print(f"lm-eval {found} already in {venv}; reusing it", flush=True)
        return venv
    if found is not None:
        print(f"{venv} holds lm-eval {found}; installing {LM_EVAL_VERSION} over it", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lm-eval-constraints-") as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(CONSTRAINTS) + "\n")
        run_plan(venv, install_plan(venv, constraints))
    if installed_version(venv) != LM_EVAL_VERSION:
        raise SystemExit(f"lm-eval {LM_EVAL_VERSION} does not import from {venv} after "
                         f"installing")
    print(f"lm-eval {LM_EVAL_VERSION} ready in {venv}", flush=True)
    return venv


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    args = parser.parse_args(argv)
    ensure_venv(args.venv)


if __name__ == "__main__":
    main()
