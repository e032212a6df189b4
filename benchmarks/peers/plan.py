"""What a peer run does: the sizes of every part (full and --quick) and the jobs they make.

Parts that need the same engine settings share one runner process per engine and repeat
(agreement + mixed: prefix caching off), so vLLM compiles its graph once for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from benchmarks.peers.job import EngineSettings, Job, Phase
from benchmarks.peers.workloads import (
    Corpus,
    PeerRequest,
    RagShape,
    Tokenize,
    mixed_requests,
    rag_requests,
    round_robin_adapters,
    warmup_requests,
)

PARTS = ("agreement", "mixed", "rag", "lora", "serving")


@dataclass(frozen=True)
class Sizes:
    """Every part's size; FULL is the issue's, QUICK a smoke run of a few minutes."""

    agreement_requests: int
    agreement_prompt: tuple[int, int]
    agreement_output: int
    mixed_requests: int
    mixed_prompt: tuple[int, int]
    mixed_output: tuple[int, int]
    rag: RagShape
    lora_adapters: int
    lora_requests: int
    lora_prompt: tuple[int, int]
    lora_output: tuple[int, int]
    serving_rates: tuple[float, ...]
    serving_requests: int
    serving_prompt: tuple[int, int]
    serving_output: tuple[int, int]
    repeats: int


FULL = Sizes(
    agreement_requests=24, agreement_prompt=(32, 512), agreement_output=64,
    mixed_requests=128, mixed_prompt=(32, 512), mixed_output=(16, 256),
    rag=RagShape(), lora_adapters=8, lora_requests=128, lora_prompt=(32, 512),
    lora_output=(16, 128), serving_rates=(0.25, 0.5, 1.0), serving_requests=32,
    serving_prompt=(32, 512), serving_output=(16, 128), repeats=2)

QUICK = Sizes(
    agreement_requests=8, agreement_prompt=(32, 256), agreement_output=64,
    mixed_requests=16, mixed_prompt=(32, 256), mixed_output=(8, 48),
    rag=RagShape(num_requests=16, num_documents=4, doc_len=320, output_len=8),
    lora_adapters=8, lora_requests=16, lora_prompt=(32, 128), lora_output=(8, 24),
    serving_rates=(1.0, 4.0), serving_requests=8, serving_prompt=(32, 128),
    serving_output=(8, 24), repeats=1)


@dataclass(frozen=True)
class PlannedJob:
    """One job (run once per engine per repeat) and the parts it measures."""

    tag: str
    job: Job
    parts: tuple[str, ...]


def offline_jobs(parts: Sequence[str], sizes: Sizes, model: str, corpus: Corpus,
                 tokenize: Tokenize, adapters: dict[str, str],
                 base: EngineSettings) -> list[PlannedJob]:
    """The offline jobs for the chosen parts (serving is not offline)."""
    warm = Phase("warmup", tuple(warmup_requests(tokenize)), timed=False)
    jobs: list[PlannedJob] = []
    plain: list[Phase] = []
    if "agreement" in parts:
        plain.append(Phase("agreement", tuple(
            PeerRequest(r.prompt_token_ids, sizes.agreement_output)
            for r in mixed_requests(corpus, sizes.agreement_requests, sizes.agreement_prompt,
                                    (1, 1), seed=17))))
    if "mixed" in parts:
        plain.append(Phase("mixed", tuple(mixed_requests(
            corpus, sizes.mixed_requests, sizes.mixed_prompt, sizes.mixed_output, seed=1))))
    if plain:
        jobs.append(PlannedJob("base", Job(model, replace(base, prefix_caching=False),
                                           (warm, *plain)),
                               tuple(p.name for p in plain)))
    if "rag" in parts:
        rag, _ = rag_requests(corpus, sizes.rag, tokenize)
        jobs.append(PlannedJob("rag", Job(model, replace(base, prefix_caching=True),
                                          (warm, Phase("rag", tuple(rag)))), ("rag",)))
    if "lora" in parts:
        names = sorted(adapters, key=lambda n: int(n.rsplit("-", 1)[-1]))
        lora = round_robin_adapters(mixed_requests(corpus, sizes.lora_requests,
                                                   sizes.lora_prompt, sizes.lora_output,
                                                   seed=2), names)
        # Every adapter is loaded and used once before timing, on both engines.
        lora_warm = Phase("warmup", tuple(warmup_requests(tokenize, names)), timed=False)
        settings = replace(base, prefix_caching=False, max_loras=len(names))
        jobs.append(PlannedJob("lora", Job(model, settings, (lora_warm, Phase("lora",
                                                                             tuple(lora))),
                                           adapters), ("lora",)))
    return jobs
