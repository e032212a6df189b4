"""Chunked-prefill interference: decode latency while long prompts arrive, chunking on vs off.

    python -m benchmarks.interference --model DIR [--quick]

A steady decode load (``--decoders`` requests of 64-token prompts generating until the end)
runs while long prompts (``--prompt-len`` tokens, 2 new ones every ``--every`` decode steps)
arrive. With chunked prefill on, each step holds at most ``--budget`` tokens, so a long
prompt is spread over several steps and every running request still gets its token each
step; with it off, a long prompt is prefilled in one step (the budget must then hold the
whole prompt) and every decode waits for it. Reports the running requests' inter-token
latency p50 / p99 / max for both settings and the p99 ratio off/on (the target: p99
ITL >= 3x lower with chunking on). Engine in-process, same seeds for both runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks.serving_metrics import nearest_rank
from engine.llm_engine import LLMEngine
from engine.models.loader import load_hf_config
from engine.sampling_params import SamplingParams

DEFAULT_OUT = Path(__file__).parent / "results" / "interference.json"


def run(model: str, chunked: bool, args: argparse.Namespace) -> dict[str, Any]:
    # Without chunking the budget must hold the longest possible prompt (the context).
    context = int(load_hf_config(model).max_position_embeddings)
    budget = args.budget if chunked else max(args.budget, context)
    engine = LLMEngine.from_model(model, enable_chunked_prefill=chunked,
                                  max_num_batched_tokens=budget, prefix_caching="off",
                                  max_num_seqs=args.decoders + 2 * args.long_prompts)
    vocab = load_hf_config(model).vocab_size
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    # Long enough to outlast the measurement (aborted at the end), short of the context.
    decode_params = SamplingParams(max_tokens=engine.max_model_len - 64, temperature=0.0,
                                   ignore_eos=True)
    for i in range(args.decoders):
        engine.add_request(f"decode-{i}", tokens(64), decode_params)
    # Warm up until every decoder is past its prefill, then measure gaps from here on.
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    added = 0
    step = 0
    long_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    while added < args.long_prompts or any(
            r.request_id.startswith("long-") for r in engine.scheduler.requests.values()):
        if added < args.long_prompts and step % args.every == 0:
            for _ in range(2):
                engine.add_request(f"long-{added}", tokens(args.prompt_len), long_params)
                added += 1
        for out in engine.step():
            if not out.request_id.startswith("decode-") or out.timing is None:
                continue
            now = out.timing.last_token
            if now is None:
                continue
            previous = last_token.get(out.request_id)
            if previous is not None:
                gaps.append(now - previous)
            last_token[out.request_id] = now
        step += 1
    for i in range(args.decoders):
        engine.abort_request(f"decode-{i}")
    ms = [g * 1000 for g in gaps]
    return {"chunked_prefill": chunked, "budget": budget, "steps": step,
            "itl_samples": len(ms), "itl_p50_ms": statistics.median(ms),
            "itl_p99_ms": nearest_rank(ms, 0.99), "itl_max_ms": max(ms)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1536)
    parser.add_argument("--long-prompts", type=int, default=12)
    parser.add_argument("--every", type=int, default=24, help="decode steps between arrivals")
    parser.add_argument("--budget", type=int, default=256,
                        help="max_num_batched_tokens with chunked prefill on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 long prompts")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.long_prompts = 4
    results = [run(args.model, chunked, args) for chunked in (True, False)]
    on, off = results
    for r in results:
        print(f"chunked prefill {'on ' if r['chunked_prefill'] else 'off'} (budget "
              f"{r['budget']}): ITL p50 {r['itl_p50_ms']:.1f} ms, p99 {r['itl_p99_ms']:.1f} "
              f"ms, max {r['itl_max_ms']:.1f} ms over {r['itl_samples']} gaps")
    ratio = off["itl_p99_ms"] / on["itl_p99_ms"]
    print(f"p99 ITL off/on: {ratio:.2f}x (target >= 3x)")
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"},
              "results": results, "p99_ratio_off_over_on": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
