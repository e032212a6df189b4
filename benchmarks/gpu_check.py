"""One prepared check of the GPU path, for a few minutes on a CUDA machine:

    python -m benchmarks.gpu_check --out DIR              # a CUDA GPU; under 8 minutes on an H200
    python -m benchmarks.gpu_check --out DIR --dry-run    # tiny shapes, CPU, Triton interpreter

Writes DIR/gpu_check.json (every figure) and DIR/summary.txt (the headline lines), rewritten
after each section so that a run cut short keeps what it measured:

1. the gpu-marked tests (native Triton kernels against their oracles);
2. the device's copy bandwidth, then the decode attention kernel at 1/8/64/256 sequences x
   1k/8k positions (Llama-3-8B attention: 32 query heads, 8 KV heads, head dim 128, bf16)
   and SGMV shrink/expand (rank 16, hidden 4096, 64 decode tokens over 1/4/16/64 adapters),
   each against that bandwidth;
3. the engine on a random-weight model of Llama-3-8B's shape: mixed-workload throughput
   against transformers' static batching, the decode step against the forward inside it at
   64 sequences (with every phase of the step), 16 LoRA adapters against none (alternated,
   twice each), and 16 adapters against PEFT's per-adapter batching on a shorter workload.

Needs torch, triton, transformers, peft, safetensors, numpy, xxhash, tokenizers and pytest
(the engine's server packages are not imported). --dry-run runs the same code on a CPU with
tiny shapes so that CI keeps it from rotting; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEST_PACKAGES = ("tests/triton_attention", "tests/lora_ops")


def _gpu_tests(dry_run: bool, packages: list[str], keyword: str) -> dict[str, Any]:
    """pytest -m gpu over the kernel test packages, each with its own conftest only (the
    suite's root conftest needs the server packages)."""
    results = {}
    for package in packages:
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "--confcutdir", package, package]
        if keyword:
            cmd += ["-k", keyword]
        if dry_run:
            cmd.append("--collect-only")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        results[package] = {"returncode": proc.returncode, "seconds": time.perf_counter() - t0,
                            "summary": lines[-1] if lines else proc.stderr[-2000:],
                            "failures": [line for line in lines if line.startswith("FAILED")],
                            "output_tail": "" if proc.returncode == 0 else proc.stdout[-6000:]}
    return results


def _summary(record: dict[str, Any]) -> list[str]:
    lines = [f"device: {record.get('environment', {}).get('device')}"]
    for package, result in record.get("gpu_tests", {}).items():
        lines.append(f"pytest -m gpu {package}: {result['summary']}")
    bandwidth = record.get("copy_bandwidth_gb_s")
    if bandwidth:
        lines.append(f"copy bandwidth: {bandwidth:.0f} GB/s")
    for row in record.get("decode_attention", []):
        lines.append(f"decode attention {row['seqs']:>3} seqs x {row['context']:>5}: "
                     f"{row['us']:9.1f} us ({row['us_with_launch']:.1f} us with launch), "
                     f"{row['gb_per_s']:7.0f} GB/s, "
                     f"{100 * row['roofline_fraction']:5.1f}% of copy bandwidth")
    for row in record.get("sgmv", []):
        lines.append(f"sgmv {row['adapters']:>2} adapters x {row['tokens']} tokens: shrink "
                     f"{row['shrink_us']:.1f} us ({100 * row['shrink_roofline_fraction']:.0f}%;"
                     f" unsplit {row['shrink_unsplit_us']:.1f} us), "
                     f"expand {row['expand_us']:.1f} us "
                     f"({100 * row['expand_roofline_fraction']:.0f}%)")
    engine = record.get("engine_checks", {})
    for key in ("engine", "engine_16_adapters", "transformers_static",
                "engine_peft_workload", "peft_per_adapter"):
        if key in engine:
            lines.append(f"{key}: {engine[key]['seconds']:.1f} s, "
                         f"{engine[key]['output_tok_per_s']:.0f} output tok/s")
    for key in ("engine_over_transformers", "adapters_over_base", "adapters_over_peft"):
        if key in engine:
            lines.append(f"{key}: {engine[key]:.2f}x")
    for key in ("decode_step_eager", "decode_step"):
        if key in engine:
            d = engine[key]
            lines.append(f"{key} at {d['seqs']} seqs: {d['step_ms']:.2f} ms, forward "
                         f"{d['forward_ms']:.2f} ms ({d['step_over_forward']:.2f}x); schedule "
                         f"{d['schedule_ms']:.2f}, prepare {d['prepare_ms']:.2f}, sample "
                         f"{d['sample_ms']:.2f}, output {d['output_ms']:.2f} ms")
    lines.extend(f"ERROR {name}: {err.splitlines()[-1] if err else ''}"
                 for name, err in record.get("errors", {}).items())
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json, summary.txt")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU under the Triton interpreter (for CI)")
    parser.add_argument("--test-packages", default=",".join(TEST_PACKAGES),
                        help="comma-separated test packages for pytest -m gpu")
    parser.add_argument("--tests-k", default="", help="pytest -k expression to run a subset")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: "
                        "tests, kernels, engine")
    args = parser.parse_args(argv)
    if args.dry_run:
        # Before any kernel module is imported: @triton.jit reads it when decorating.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from benchmarks import gpu_engine_check as eng
    from benchmarks import gpu_kernel_timings as kt

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu_check needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    record: dict[str, Any] = {"dry_run": args.dry_run, "errors": {}, "environment": {
        "python": platform.python_version(), "torch": torch.__version__,
        "triton": _version("triton"), "transformers": _version("transformers"),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)",
        "multiprocessors": (torch.cuda.get_device_properties(device).multi_processor_count
                            if cuda else None)}}

    def save() -> None:
        (out / "gpu_check.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / "summary.txt").write_text("\n".join(_summary(record)) + "\n")

    def section(name: str, fn: Callable[[], None]) -> None:
        if name in skip:
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:  # one section's failure must not lose the others' figures
            record["errors"][name] = traceback.format_exc()
        record.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        save()
        print(f"[gpu_check] {name}: {time.perf_counter() - t0:.1f} s", flush=True)

    bf16 = torch.bfloat16 if cuda else torch.float32
    bandwidth = 1.0

    def tests() -> None:
        record["gpu_tests"] = _gpu_tests(args.dry_run,
                                         [p for p in args.test_packages.split(",") if p],
                                         args.tests_k)

    def kernels() -> None:
        nonlocal bandwidth
        bandwidth = kt.copy_bandwidth(device, 4 << 30 if cuda else 1 << 20, 20 if cuda else 2)
        record["copy_bandwidth_gb_s"] = bandwidth / 1e9
        if cuda:
            record["decode_attention"] = kt.decode_attention_timings(
                device, bandwidth, [1, 8, 64, 256], [1024, 8192], 32, 8, 128, 16, bf16, 20)
            record["sgmv"] = kt.sgmv_timings(device, bandwidth, [1, 4, 16, 64], 4096, 16, 64,
                                             bf16, 50)
        else:
            record["decode_attention"] = kt.decode_attention_timings(
                device, bandwidth, [1, 3], [40], 4, 2, 32, 8, bf16, 1)
            record["sgmv"] = kt.sgmv_timings(device, bandwidth, [1, 4], 64, 4, 8, bf16, 1)

    def engine() -> None:
        checks: dict[str, Any] = {}
        record["engine_checks"] = checks
        with tempfile.TemporaryDirectory() as tmp:
            knobs: dict[str, Any]
            shape: dict[str, Any]
            if cuda:
                shape = eng.LLAMA3_8B_SHAPE
                workload = eng.Workload.mixed(128, (64, 1024), (32, 256), 8000)
                # PEFT serves adapters one static batch at a time: 2 requests per adapter,
                # short outputs, to keep its part near half a minute.
                peft_workload = eng.Workload.mixed(32, (64, 1024), (16, 64), 8000, seed=1)
                knobs = {"max_num_seqs": 64, "max_num_batched_tokens": 4096,
                         "kv_cache_memory_bytes": 40 << 30, "max_model_len": 2048}
                eng.engine_checks(Path(tmp), shape, device, "bfloat16", workload, peft_workload,
                                  knobs, 64, 64, 512, 20, 16, 16, checks)
            else:
                shape = eng.TINY_SHAPE
                workload = eng.Workload.mixed(4, (4, 20), (2, 4), 500)
                peft_workload = eng.Workload.mixed(4, (4, 20), (2, 3), 500, seed=1)
                knobs = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8,
                         "num_kv_blocks": 64, "max_model_len": 256, "attention_backend": "triton"}
                eng.engine_checks(Path(tmp), shape, device, "float32", workload, peft_workload,
                                  knobs, 4, 2, 8, 2, 2, 4, checks)

    section("tests", tests)
    section("kernels", kernels)
    section("engine", engine)
    print("\n".join(_summary(record)))
    return 1 if record["errors"] else 0


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
