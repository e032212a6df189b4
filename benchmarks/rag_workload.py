"""A seeded RAG workload: shared system prompt + k retrieved documents + a question.

Documents are drawn with Zipf popularity, laid out in a stable order (ascending document id)
so that requests retrieving the same documents share the longest possible prefix, and
requests arrive as a Poisson process. With ``turns_per_session`` > 1 the requests are
conversations over their retrieved documents (what a RAG chat backend serves): each
follow-up's prompt is the previous turn's prompt + that turn's answer + a new question, so a
conversation's own history is a prefix only the instance that served it has cached.
``theoretical_reuse`` computes, from the request list alone, the share of prompt tokens an
unbounded prefix cache could serve.

The token ids come from a ``Corpus``: random ids by default (any model, no tokenizer), or
real text framed by the model's chat template (benchmarks/text_corpus.py), so a real model
answers real questions and its outputs can be read.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.workloads import NUM_SPECIAL_IDS
from prefix_cache.hashing import chain_hashes


@dataclass(frozen=True)
class RagSpec:
    """Shape of the RAG workload (the defaults are the RAG benchmark's)."""

    num_requests: int = 200
    num_documents: int = 64
    doc_len: tuple[int, int] = (128, 512)
    system_prompt_len: int = 256
    docs_per_request: int = 3
    question_len: tuple[int, int] = (16, 32)
    output_len: int = 32
    zipf_s: float = 1.1
    rate: float = 4.0
    """Mean arrivals per second (Poisson)."""
    shuffle_docs: bool = False
    """Random document order per request (the cache-unfriendly layout)."""
    turns_per_session: int = 1
    """Requests per conversation; 1 = independent single-turn requests."""
    mean_turn_gap_s: float = 8.0
    """Mean seconds between a conversation's turns (exponential: the user reads and types)."""
    vocab_size: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if self.turns_per_session < 1:
            raise ValueError(f"turns_per_session must be >= 1, got {self.turns_per_session}")


@dataclass(frozen=True)
class RagRequest:
    """One request: prompt token ids, output length and arrival offset in seconds."""

    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float
    doc_ids: tuple[int, ...]
    session_id: int = 0
    """The conversation this request belongs to (its index when turns_per_session is 1)."""


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(NUM_SPECIAL_IDS, vocab) for _ in range(n)]


@dataclass(frozen=True)
class Corpus:
    """What prompts are made of. A prompt is ``system`` + its documents in order +
    ``question(rng, doc_ids)``; a follow-up turn appends ``filler(rng, n)`` (the stand-in for
    the answer the client was shown) and a new question."""

    documents: list[list[int]]
    system: list[int]
    """Everything before the first document: the shared prefix of every request."""
    question: Callable[[random.Random, tuple[int, ...]], list[int]]
    """Token ids after the documents, up to where the model starts its answer."""
    filler: Callable[[random.Random, int], list[int]]


def random_corpus(spec: RagSpec, rng: random.Random) -> Corpus:
    """Uniformly random token ids (no special ids) of the spec's lengths."""
    docs = [_tokens(rng, rng.randint(*spec.doc_len), spec.vocab_size)
            for _ in range(spec.num_documents)]
    system = _tokens(rng, spec.system_prompt_len, spec.vocab_size)
    return Corpus(
        docs, system,
        question=lambda r, _docs: _tokens(r, r.randint(*spec.question_len), spec.vocab_size),
        filler=lambda r, n: _tokens(r, n, spec.vocab_size))


def _zipf_sample(rng: random.Random, weights: list[float], k: int) -> list[int]:
    """k distinct ids drawn with probability proportional to weights."""
    chosen: set[int] = set()
    ids = list(range(len(weights)))
    while len(chosen) < k:
        chosen.add(rng.choices(ids, weights=weights)[0])
    return sorted(chosen)


CorpusFactory = Callable[[RagSpec, random.Random], Corpus]


def make_rag_workload(spec: RagSpec, corpus: CorpusFactory = random_corpus
                      ) -> list[RagRequest]:
    """``spec.num_requests`` requests in arrival order. Conversations start as a Poisson
    process at ``rate / turns_per_session`` (so requests arrive at ``rate`` on average) and
    the first ``num_requests`` turns by arrival time are kept. ``corpus`` builds the
    documents from the workload's seeded generator (it must make ``spec.num_documents``)."""
    rng = random.Random(spec.seed)
    built = corpus(spec, rng)
    docs, system = built.documents, built.system
    if len(docs) != spec.num_documents:
        raise ValueError(f"the corpus has {len(docs)} documents, the spec asks for "
                         f"{spec.num_documents}")
    weights = [1.0 / (rank + 1) ** spec.zipf_s for rank in range(spec.num_documents)]
    turns = spec.turns_per_session
    num_sessions = -(-spec.num_requests // turns)
    start = 0.0
    requests = []
    for session in range(num_sessions):
        doc_ids = _zipf_sample(rng, weights, spec.docs_per_request)
        if spec.shuffle_docs:
            rng.shuffle(doc_ids)
        prompt = list(system)
        for d in doc_ids:
            prompt.extend(docs[d])
        prompt.extend(built.question(rng, tuple(doc_ids)))
        requests.append(RagRequest(prompt, spec.output_len, start, tuple(doc_ids), session))
        arrival = start
        for _ in range(turns - 1):
            # The client sends back the answer it was shown; the workload is made before
            # any answer exists, so a stand-in answer of the same length takes its place.
            prompt = [*prompt, *built.filler(rng, spec.output_len),
                      *built.question(rng, tuple(doc_ids))]
            arrival += rng.expovariate(1.0 / spec.mean_turn_gap_s)
            requests.append(RagRequest(prompt, spec.output_len, arrival, tuple(doc_ids),
                                       session))
        start += rng.expovariate(spec.rate / turns)
    requests.sort(key=lambda r: r.arrival_s)
    return requests[:spec.num_requests]


def theoretical_reuse(requests: list[RagRequest], block_size: int, warm: int = 0) -> float:
    """Share of prompt tokens that an unbounded, block-granular prefix cache could serve
    (each hit capped at prompt_len - 1, as the engine caps it), in arrival order. The first
    ``warm`` requests only fill the cache (a warm-up, not counted)."""
    seen: set[int] = set()
    reusable = total = 0
    for i, request in enumerate(requests):
        hashes = chain_hashes(request.prompt_token_ids, block_size)
        cap = (len(request.prompt_token_ids) - 1) // block_size
        hit = 0
        while hit < min(cap, len(hashes)) and hashes[hit] in seen:
            hit += 1
        if i >= warm:
            reusable += hit * block_size
            total += len(request.prompt_token_ids)
        seen.update(hashes)
    return reusable / total if total else 0.0
