"""RAG prefix-caching benchmark: caching off / on / auto on one workload, in one run.

    python -m benchmarks.prefix_cache --model DIR [--num-requests 200] [--load 0.8] [--quick]

Each mode serves the same requests twice:
1. throughput: every request queued at once, the engine steps as fast as it can; reports
   requests/s and output tokens/s (its capacity), prompt tokens computed and the hit rate
   beside the workload's theoretical reusable fraction;
2. latency: Poisson arrivals in real time at ``--load`` x the capacity the cached ("on")
   engine measured in (1), so TTFT reflects a load the cached engine sustains; reports TTFT
   p50/p99. (``--rate R`` fixes the rate instead.)
Both start from an empty cache, so the first use of every document and document
combination is a miss: a cold start. A server that has been up for a while has the hot set
cached; so the cached modes measure capacity once more in steady state: the engine first
serves ``--warm-requests`` other requests drawn from the same corpus and popularity (not
timed), then the same measured requests (caching off has nothing to warm; its capacity is
the same). The KV pool (``--kv-blocks``) is sized to hold the hot set.
Then the on/off ratios against their targets; a variant with shuffled document order
shows what an unstable layout costs.

The capacity ratio depends on the model's shape: prefix caching saves the projections and
attention of the cached tokens, not the attention of the computed tokens over the whole
~1,300-token context nor the decode steps. On the default demo shape (hidden 512) that
attention is ~45% of a token's FLOPs, far above a real model's (~5-15%), so the capacity
runs are repeated on the "wide" demo shape (engine/demo_shapes.py WIDE_SPEC, ~20%), built in
a temporary directory unless ``--wide-model`` names one (``--no-wide``: skip; ``--quick``
skips it unless named).

The prompts (``--corpus``) are random token ids on a random-weight demo model (its answers are
noise either way, and the figures stay comparable with earlier runs) and real text otherwise:
sections of the Python language reference and a question about one of them, in the model's
chat format (benchmarks/text_corpus.py); the first answers of the cached run are printed and
kept in the report, so a real model's output can be checked by eye. Every request generates
exactly its output length (ignore_eos), so every mode does the same work; the answers shown
stop at the first end-of-sequence token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from transformers import AutoTokenizer

from benchmarks.rag_workload import (
    CorpusFactory,
    RagRequest,
    RagSpec,
    make_rag_workload,
    random_corpus,
    theoretical_reuse,
)
from benchmarks.serving_metrics import nearest_rank
from benchmarks.text_corpus import text_corpus
from engine.demo_model import make_demo_model
from engine.demo_shapes import WIDE_SPEC
from engine.llm_engine import LLMEngine
from engine.models.loader import load_hf_config
from engine.sampling_params import SamplingParams

SAMPLE_ANSWERS = 3
"""How many of the measured requests' answers each run keeps (the first ones)."""


@dataclass(frozen=True)
class ModeResult:
    model: str
    """"model" (--model) or "wide" (the wide-shape model)."""
    mode: str
    layout: str
    phase: str
    requests: int
    prompt_tokens: int
    prompt_tokens_computed: int
    hit_rate: float
    theoretical_reuse: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    output_tokens_per_s: float
    makespan_s: float
    answers: tuple[str, ...] = ()
    """The first SAMPLE_ANSWERS requests' answers, up to the first end-of-sequence token."""


def _greedy(request: RagRequest) -> SamplingParams:
    """Exactly the request's output length, greedy (the same work in every mode)."""
    return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)


def _answer(engine: LLMEngine, token_ids: list[int]) -> str:
    """The answer's text up to its first end-of-sequence token (ignore_eos runs on)."""
    end = next((i for i, t in enumerate(token_ids) if t in engine.eos_token_ids),
               len(token_ids))
    return str(engine.tokenizer.decode(token_ids[:end], skip_special_tokens=True)).strip()


def run_mode(model: str, mode: str, requests: list[RagRequest], layout: str,
             engine_kwargs: dict[str, object], rate: float | None = None,
             warmup: list[RagRequest] | None = None, label: str = "model") -> ModeResult:
    """Serve requests; rate None queues them all at once, else Poisson at that rate. The
    warm-up requests, if any, are served first (all at once, not timed or counted)."""
    warmup = warmup or []
    if rate is None:
        requests = [replace(r, arrival_s=0.0) for r in requests]
    else:
        scale = requests[-1].arrival_s / max(1e-9, (len(requests) - 1) / rate)
        requests = [replace(r, arrival_s=r.arrival_s / scale) for r in requests]
    engine = LLMEngine.from_model(model, prefix_caching=mode, **engine_kwargs)
    # Warm the code paths (not the cache: a different document) before the clock starts.
    engine.add_request("warmup", list(range(100, 400)), SamplingParams(max_tokens=4,
                                                                       ignore_eos=True))
    for i, r in enumerate(warmup):
        engine.add_request(f"warm-{i}", r.prompt_token_ids, _greedy(r))
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.stats()

    start = time.monotonic()
    pending = list(enumerate(requests))
    ttft: list[float] = []
    answers: dict[str, str] = {}
    sampled = {f"rag-{i}" for i in range(SAMPLE_ANSWERS)}
    finished_at = start
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and start + pending[0][1].arrival_s <= now:
            i, r = pending.pop(0)
            engine.add_request(f"rag-{i}", r.prompt_token_ids, _greedy(r),
                               arrival_time=start + r.arrival_s)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0][1].arrival_s - time.monotonic()))
            continue
        for out in engine.step():
            if out.finished:
                assert out.timing is not None and out.timing.ttft is not None
                ttft.append(out.timing.ttft)
                finished_at = time.monotonic()
                if out.request_id in sampled:
                    answers[out.request_id] = _answer(engine, out.token_ids)
    after = engine.stats()
    makespan = finished_at - start
    prompt_tokens = after.prompt_tokens - before.prompt_tokens
    hit_tokens = after.prefix_cache.hit_tokens - before.prefix_cache.hit_tokens
    phase = "throughput" if rate is None else f"rate {rate:.3f}"
    return ModeResult(
        model=label, mode=mode, layout=layout, phase=f"warm {phase}" if warmup else phase,
        requests=len(requests), prompt_tokens=prompt_tokens,
        prompt_tokens_computed=after.prompt_tokens_computed - before.prompt_tokens_computed,
        hit_rate=hit_tokens / prompt_tokens,
        theoretical_reuse=theoretical_reuse([*warmup, *requests], engine.config.block_size,
                                            warm=len(warmup)),
        ttft_p50_s=statistics.median(ttft), ttft_p99_s=nearest_rank(ttft, 0.99),
        throughput_rps=len(requests) / makespan,
        output_tokens_per_s=sum(r.output_len for r in requests) / makespan,
        makespan_s=makespan,
        answers=tuple(answers[k] for k in sorted(answers)),
    )


def _samples(model: str, requests: list[RagRequest], result: ModeResult
             ) -> list[dict[str, str]]:
    """The end of the first prompts (the question) beside their answers, printed: what a
    reader checks to see that a real model answers sensibly."""
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    samples = []
    for request, answer in zip(requests, result.answers, strict=False):
        tail = str(tokenizer.decode(request.prompt_token_ids[-40:], skip_special_tokens=True))
        samples.append({"prompt_tail": tail.strip(), "answer": answer})
        print(f"  prompt ...{tail.strip()[-160:]!r}\n  answer: {answer!r}", flush=True)
    return samples


def _print_table(results: list[ModeResult]) -> None:
    print(f"{'model':<7}{'layout':<9}{'mode':<6}{'phase':<18}{'computed':>10}{'hit rate':>10}"
          f"{'theory':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'req/s':>8}{'tok/s':>8}")
    for r in results:
        print(f"{r.model:<7}{r.layout:<9}{r.mode:<6}{r.phase:<18}{r.prompt_tokens_computed:>10}"
              f"{r.hit_rate:>10.1%}{r.theoretical_reuse:>8.1%}{r.ttft_p50_s:>9.2f}s"
              f"{r.ttft_p99_s:>9.2f}s{r.throughput_rps:>8.2f}{r.output_tokens_per_s:>8.1f}")


def is_demo_model(model: str) -> bool:
    """A random-weight model written by ``loragate make-demo``."""
    return (Path(model) / "loragate_demo.json").is_file()


def corpus_for(model: str, corpus: str) -> CorpusFactory:
    """The prompts' corpus: "random" ids, "text" in the model's chat format, or "auto"
    (random on a demo model, text otherwise)."""
    if corpus == "auto":
        corpus = "random" if is_demo_model(model) else "text"
    if corpus == "random":
        return random_corpus
    return text_corpus(AutoTokenizer.from_pretrained(model, local_files_only=True))


def _workloads(spec: RagSpec, model: str, num_warm: int, corpus: str
               ) -> tuple[list[RagRequest], list[RagRequest], list[RagRequest]]:
    """(measured, warm-up, shuffled) requests over the model's vocabulary."""
    spec = replace(spec, vocab_size=load_hf_config(model).vocab_size)
    factory = corpus_for(model, corpus)
    # The generator draws requests one after another from one stream, so the first
    # num_requests of a longer list are exactly the measured list; the rest are independent
    # draws from the same corpus and popularity, used as the warm-up.
    drawn = make_rag_workload(replace(spec, num_requests=spec.num_requests + num_warm),
                              factory)
    shuffled = make_rag_workload(replace(spec, shuffle_docs=True), factory)
    return drawn[:spec.num_requests], drawn[spec.num_requests:], shuffled


def _capacity_ratios(capacity: dict[str, ModeResult], warm: dict[str, ModeResult]
                     ) -> dict[str, float]:
    """Capacity on/off and prompt tokens computed off/on, cold and (if run) steady state."""
    off = capacity["off"]
    ratios = {
        "throughput_on_over_off": capacity["on"].throughput_rps / off.throughput_rps,
        "prompt_tokens_computed_off_over_on": off.prompt_tokens_computed
        / max(1, capacity["on"].prompt_tokens_computed),
    }
    if "on" in warm:
        ratios.update({
            "warm_hit_rate_over_theoretical": warm["on"].hit_rate / warm["on"].theoretical_reuse,
            "warm_throughput_on_over_off": warm["on"].throughput_rps / off.throughput_rps,
            "warm_prompt_tokens_computed_off_over_on": off.prompt_tokens_computed
            / max(1, warm["on"].prompt_tokens_computed),
        })
    return ratios


def _print_capacity(label: str, ratios: dict[str, float], warm: dict[str, ModeResult],
                    num_warm: int) -> None:
    print(f"{label}: throughput on/off (capacity, cold cache): "
          f"{ratios['throughput_on_over_off']:.2f}x (target >= 3x); prompt tokens "
          f"computed off/on {ratios['prompt_tokens_computed_off_over_on']:.2f}x")
    if "on" in warm:
        print(f"{label}: steady state (after {num_warm} warm-up requests): hit rate "
              f"{warm['on'].hit_rate:.1%} of {warm['on'].theoretical_reuse:.1%} theoretical; "
              f"throughput on/off {ratios['warm_throughput_on_over_off']:.2f}x "
              f"(target >= 3x); prompt tokens computed off/on "
              f"{ratios['warm_prompt_tokens_computed_off_over_on']:.2f}x")


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--num-documents", type=int, default=64)
    parser.add_argument("--load", type=float, default=0.8,
                        help="latency phase rate as a fraction of the cached engine's capacity")
    parser.add_argument("--rate", type=float, default=None,
                        help="fixed Poisson rate (req/s) for the latency phase instead")
    parser.add_argument("--capacity-only", action="store_true",
                        help="skip the latency phase and the shuffled layout (faster)")
    parser.add_argument("--modes", default="on,off,auto",
                        help="caching modes to run, comma-separated (on and off required)")
    parser.add_argument("--no-shuffled", action="store_true",
                        help="skip the shuffled-layout runs")
    parser.add_argument("--corpus", choices=("auto", "random", "text"), default="auto",
                        help="prompts: random ids, Python reference text in the model's chat "
                             "format, or auto (random on a loragate demo model, else text)")
    parser.add_argument("--warm-requests", type=int, default=400,
                        help="requests served before the steady-state capacity runs (0: skip "
                             "them)")
    parser.add_argument("--kv-blocks", type=int, default=16384,
                        help="KV pool size in blocks (default: holds the warmed hot set)")
    parser.add_argument("--wide-model", default=None, metavar="DIR",
                        help="the model for the wide-shape capacity runs (default: build the "
                             "wide demo shape in a temporary directory)")
    parser.add_argument("--no-wide", action="store_true",
                        help="skip the wide-shape capacity runs")
    parser.add_argument("--quick", action="store_true",
                        help="60 requests, 60 warm-up, no wide-shape runs unless --wide-model")
    parser.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    args = parser.parse_args(argv)

    num_requests = 60 if args.quick else args.num_requests
    num_warm = min(60, args.warm_requests) if args.quick else args.warm_requests
    spec = RagSpec(num_requests=num_requests, num_documents=args.num_documents,
                   vocab_size=load_hf_config(args.model).vocab_size)
    engine_kwargs: dict[str, object] = dict(max_num_batched_tokens=512, max_num_seqs=64,
                                            num_kv_blocks=args.kv_blocks)
    modes = tuple(m for m in ("on", "off", "auto") if m in args.modes.split(","))
    if not {"on", "off"} <= set(modes):
        parser.error(f"--modes needs on and off, got {args.modes!r}")
    if args.capacity_only:
        modes = ("on", "off")

    def capacity_runs(model: str, label: str, stable: list[RagRequest],
                      warm_up: list[RagRequest]
                      ) -> tuple[dict[str, ModeResult], dict[str, ModeResult]]:
        """Cold capacity in each mode, then steady-state capacity in the cached modes."""
        cold = {m: run(model, label, m, "stable", stable, None) for m in modes}
        warm = {m: run(model, label, m, "stable", stable, None, warm_up)
                for m in modes if m != "off"} if warm_up else {}
        return cold, warm

    def run(model: str, label: str, mode: str, layout: str, requests: list[RagRequest],
            rate: float | None, warm_up: list[RagRequest] | None = None) -> ModeResult:
        print(f"{label} / {layout} / {mode} / "
              f"{'all at once' if rate is None else f'{rate:.3f} req/s'}"
              f"{f' after {len(warm_up)} warm-up requests' if warm_up else ''}", flush=True)
        result = run_mode(model, mode, requests, layout, engine_kwargs, rate, warm_up, label)
        print(f"  {result.throughput_rps:.3f} req/s, hit rate {result.hit_rate:.1%}, TTFT p50 "
              f"{result.ttft_p50_s:.2f}s", flush=True)
        return result

    stable, warm_up, shuffled = _workloads(spec, args.model, num_warm, args.corpus)
    capacity, warm = capacity_runs(args.model, "model", stable, warm_up)
    samples = _samples(args.model, stable, capacity["on"])
    rate = args.rate or args.load * capacity["on"].throughput_rps
    latency = {} if args.capacity_only else {m: run(args.model, "model", m, "stable", stable,
                                                    rate) for m in ("off", "on", "auto")
                                             if m in modes}
    shuffled_results = [] if args.capacity_only or args.no_shuffled else [
        run(args.model, "model", "on", "shuffled", shuffled, None),
        run(args.model, "model", "on", "shuffled", shuffled, rate)]

    wide_capacity: dict[str, ModeResult] = {}
    wide_warm: dict[str, ModeResult] = {}
    if args.wide_model or not (args.no_wide or args.quick):
        with tempfile.TemporaryDirectory(prefix="loragate-wide-") as tmp:
            wide_model = args.wide_model or str(make_demo_model(tmp, WIDE_SPEC))
            wide_stable, wide_warm_up, _ = _workloads(spec, wide_model, num_warm,
                                                      args.corpus)
            wide_capacity, wide_warm = capacity_runs(wide_model, "wide", wide_stable,
                                                     wide_warm_up)

    results = [*capacity.values(), *latency.values(), *warm.values(), *shuffled_results,
               *wide_capacity.values(), *wide_warm.values()]
    _print_table(results)

    on = latency.get("on")
    off = latency.get("off")
    ratios = _capacity_ratios(capacity, warm)
    wide_ratios = _capacity_ratios(wide_capacity, wide_warm) if wide_capacity else {}
    summary: dict[str, object] = {
        "latency_rate_rps": rate,
        "auto_hit_rate": capacity["auto"].hit_rate if "auto" in capacity else None,
        "hit_rate_over_theoretical": capacity["on"].hit_rate / capacity["on"].theoretical_reuse,
        "ttft_p50_on_over_off": on.ttft_p50_s / off.ttft_p50_s if on and off else None,
        **ratios,
        "shuffled_hit_rate": shuffled_results[0].hit_rate if shuffled_results else None,
        "warm_requests": len(warm_up),
    }
    summary.update({f"wide_{key}": value for key, value in wide_ratios.items()})
    print(f"\nhit rate / theoretical: {summary['hit_rate_over_theoretical']:.3f} "
          f"(target >= 0.95)")
    if summary["ttft_p50_on_over_off"] is not None:
        print(f"TTFT p50 on/off at {rate:.3f} req/s: {summary['ttft_p50_on_over_off']:.3f} "
              f"(target <= 0.25)")
    _print_capacity("--model", ratios, warm, len(warm_up))
    if wide_ratios:
        _print_capacity("wide shape", wide_ratios, wide_warm, len(warm_up))
    if summary["shuffled_hit_rate"] is not None:
        print(f"shuffled layout hit rate: {summary['shuffled_hit_rate']:.1%} "
              f"(stable: {capacity['on'].hit_rate:.1%})")
    report: dict[str, object] = {"spec": asdict(spec), "engine": engine_kwargs,
                                 "corpus": args.corpus, "samples": samples,
                                 "results": [asdict(r) for r in results], "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
