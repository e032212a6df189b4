"""Host-side cost of one decode step: scheduling plus the runner's input preparation.

    python -m benchmarks.decode_prep [--requests 128] [--context 4096] [--steps 20]

``--requests`` requests of ``--context`` tokens (a shared prefix plus a short tail of
their own, so prefix caching keeps the warm-up prefill short) run until every one of them
decodes; then the engine's own step timing (engine/metrics.py StepTiming) is read for
``--steps`` decode steps, with and without the runner's persistent decode buffers
(engine/decode_graphs.py), alternated: ``schedule`` (Scheduler.schedule, what it hands the runner
included) and ``prepare`` (the runner applying that output and building the step's flat
inputs and attention metadata). The forward itself is not part of the figure. The model is
a tiny seeded demo model (engine/demo_model.py): the costs measured here do not depend on
its width. Cascade attention is off so that ``prepare`` is the generic path's. torch runs
on ``--threads`` threads (default 1): on a shared machine more threads make these small
host-side tensor operations wait for cores, which is noise, not the cost measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from engine.demo_model import make_demo_model
from engine.demo_shapes import DemoModelSpec
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

TAIL = 64  # tokens of each request's own after the shared prefix
BLOCK = 16


def measure(requests: int, context: int, steps: int, model_dir: Path,
            static_buffers: bool = True) -> dict[str, float]:
    """Median and best schedule / prepare milliseconds of ``steps`` decode steps.
    static_buffers: decode steps on the runner's persistent buffers (engine/decode_graphs.py),
    or off: inputs and attention metadata built anew each step."""
    engine = LLMEngine.from_model(
        str(model_dir), device="cpu", block_size=BLOCK, max_num_seqs=requests,
        max_num_batched_tokens=max(2048, requests), max_model_len=context + steps + 64,
        num_kv_blocks=(context + steps + 64) // BLOCK * requests + 64,
        prefix_caching="on", cascade_attention=False, cuda_graphs=static_buffers)
    shared = [10 + i % 400 for i in range(context - TAIL)]
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"r{i}", shared + [10 + (i * 7 + j) % 400 for j in range(TAIL)],
                           params)
    while not (len(engine.scheduler.running) == requests and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)):
        engine.step()
    schedule: list[float] = []
    prepare: list[float] = []
    for _ in range(steps):
        engine.step()
        timing = engine.metrics.last_step
        assert timing is not None
        schedule.append(timing.schedule * 1e3)
        prepare.append(timing.prepare * 1e3)
    return {"requests": requests, "context": context, "steps": steps,
            "static_buffers": static_buffers,
            "schedule_ms_p50": round(statistics.median(schedule), 3),
            "prepare_ms_p50": round(statistics.median(prepare), 3),
            "schedule_ms_min": round(min(schedule), 3),
            "prepare_ms_min": round(min(prepare), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = DemoModelSpec(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                         num_heads=4, num_kv_heads=2,
                         max_position_embeddings=args.context + args.steps + 64)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_demo_model(Path(tmp) / "model", spec)
        # Alternated, twice each: the host is shared and noisy.
        for static in (False, True, False, True):
            print(json.dumps(measure(args.requests, args.context, args.steps, model_dir,
                                     static)))


if __name__ == "__main__":
    main()
