"""The peer benchmark's workloads, built from real text and handed to both engines as token ids.

The text is the Python Language Reference that ships with Python (``pydoc_data.topics``: 79
topics, ~465k characters), tokenized once with the model's own tokenizer. Both engines get
the same token ids, so tokenizers and chat templates play no part in the comparison, and
every request carries an exact output length (the engines run with ignore_eos).

- mixed: prompts are slices of the token stream at seeded offsets, prompt and output lengths
  drawn uniformly from their ranges (the issue's 32-512 / 16-256).
- rag: ``num_documents`` documents of ``doc_len`` tokens, each the head of a different topic;
  every request is one document (Zipf popularity) + a distinct question (a slice of text
  no document contains) + an answer cue.
- lora: the mixed shape with adapters assigned round-robin.
- agreement: fixed-shape requests (prompt slices, ``output_len`` tokens each) whose greedy
  outputs are compared token for token.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Tokenize = Callable[[str], list[int]]
"""Text -> token ids without special tokens."""


@dataclass(frozen=True)
class PeerRequest:
    """One request as both engines receive it."""

    prompt_token_ids: tuple[int, ...]
    output_len: int
    lora: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"prompt_token_ids": list(self.prompt_token_ids), "output_len": self.output_len,
                "lora": self.lora}


@dataclass(frozen=True)
class Corpus:
    """The reference text tokenized: one id list per topic (sorted by topic name)."""

    topics: tuple[tuple[int, ...], ...]

    @classmethod
    def load(cls, tokenize: Tokenize) -> Corpus:
        import pydoc_data.topics

        texts = [text for _, text in sorted(pydoc_data.topics.topics.items()) if text.strip()]
        return cls(tuple(tuple(tokenize(text)) for text in texts))

    @property
    def stream(self) -> tuple[int, ...]:
        """Every topic's tokens end to end."""
        return tuple(t for topic in self.topics for t in topic)


def _slice(rng: random.Random, tokens: Sequence[int], length: int) -> tuple[int, ...]:
    if length > len(tokens):
        raise ValueError(f"need {length} tokens, the text has {len(tokens)}")
    start = rng.randrange(len(tokens) - length + 1)
    return tuple(tokens[start:start + length])


def mixed_requests(corpus: Corpus, num_requests: int, prompt_len: tuple[int, int],
                   output_len: tuple[int, int], seed: int = 0) -> list[PeerRequest]:
    """Slices of real text of uniform random length, each with a uniform random output length."""
    rng = random.Random(seed)
    stream = corpus.stream
    return [PeerRequest(_slice(rng, stream, rng.randint(*prompt_len)), rng.randint(*output_len))
            for _ in range(num_requests)]


def round_robin_adapters(requests: Sequence[PeerRequest], adapters: Sequence[str]
                         ) -> list[PeerRequest]:
    """Request i gets adapter i mod len(adapters)."""
    if not adapters:
        raise ValueError("round_robin_adapters needs at least one adapter")
    return [PeerRequest(r.prompt_token_ids, r.output_len, adapters[i % len(adapters)])
            for i, r in enumerate(requests)]


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ranks 0..n-1: proportional to 1 / (rank + 1) ** s."""
    return [1.0 / (rank + 1) ** s for rank in range(n)]


@dataclass(frozen=True)
class RagShape:
    """Shape of the RAG workload (the issue's: 8 x ~1,000-token documents, 96 requests)."""

    num_requests: int = 96
    num_documents: int = 8
    doc_len: int = 1000
    question_len: int = 30
    output_len: int = 32
    zipf_s: float = 1.1
    seed: int = 0


def rag_requests(corpus: Corpus, shape: RagShape, tokenize: Tokenize
                 ) -> tuple[list[PeerRequest], list[int]]:
    """The requests and, for each, the index of its document.

    Documents are the heads of ``num_documents`` seeded topics at least ``doc_len`` tokens
    long; questions are distinct slices of the remaining topics, so no question repeats
    a document's text and no two requests share more than their document."""
    rng = random.Random(shape.seed)
    long_topics = [i for i, t in enumerate(corpus.topics) if len(t) >= shape.doc_len]
    if len(long_topics) < shape.num_documents:
        raise ValueError(f"only {len(long_topics)} topics have {shape.doc_len} tokens")
    chosen = rng.sample(long_topics, shape.num_documents)
    documents = [corpus.topics[i][:shape.doc_len] for i in chosen]
    rest = tuple(t for i, topic in enumerate(corpus.topics) if i not in chosen for t in topic)
    # Disjoint question windows: shuffled, non-overlapping slices of the remaining text.
    windows = list(range(0, len(rest) - shape.question_len + 1, shape.question_len))
    if len(windows) < shape.num_requests:
        raise ValueError(f"text too short for {shape.num_requests} distinct questions")
    rng.shuffle(windows)
    lead, cue = tuple(tokenize("\n\nQuestion:")), tuple(tokenize("\nAnswer:"))
    weights = zipf_weights(shape.num_documents, shape.zipf_s)
    requests, doc_of = [], []
    for start in windows[:shape.num_requests]:
        doc = rng.choices(range(shape.num_documents), weights=weights)[0]
        question = rest[start:start + shape.question_len]
        requests.append(PeerRequest(documents[doc] + lead + question + cue, shape.output_len))
        doc_of.append(doc)
    return requests, doc_of


def warmup_requests(tokenize: Tokenize, adapters: Sequence[str | None] = (None,)
                    ) -> list[PeerRequest]:
    """One short request per adapter (None = base) whose text appears in no workload, so a
    warm-up leaves nothing in a prefix cache that the measured run could reuse."""
    ids = tuple(tokenize("Warm-up: the quick brown fox jumps over the lazy dog, twice over."))
    return [PeerRequest(ids, 4, adapter) for adapter in adapters]
