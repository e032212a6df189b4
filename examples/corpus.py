"""A real document corpus that ships with Python itself, and BM25 retrieval over it.

The corpus: the Python Language Reference topics in the standard library's
``pydoc_data.topics`` (what ``help("with")`` prints): 79 topics, ~465k characters of real
technical prose, cut into passages of about ``passage_words`` words on paragraph
boundaries. Nothing is downloaded.

Retrieval is BM25 (``rank_bm25``): no embedding model can be fetched here, and for keyword-
heavy questions over technical reference text BM25 is a strong, transparent baseline. The
retrieved passages are returned in ascending passage id, not by score: a stable order makes
requests that retrieve the same passages share a prompt prefix, which the prefix cache
turns into skipped prefill.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rank_bm25 import BM25Okapi

_WORD = re.compile(r"[a-z0-9_]+")


@dataclass(frozen=True)
class Passage:
    """One retrievable passage: a stable id, the topic it came from, its text."""

    passage_id: int
    topic: str
    text: str


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def load_passages(passage_words: int = 180) -> list[Passage]:
    """The reference topics cut into passages of about passage_words words."""
    import pydoc_data.topics

    passages: list[Passage] = []
    for topic, text in sorted(pydoc_data.topics.topics.items()):
        chunk: list[str] = []
        words = 0
        for paragraph in (p.strip() for p in text.split("\n\n")):
            if not paragraph:
                continue
            chunk.append(paragraph)
            words += len(paragraph.split())
            if words >= passage_words:
                passages.append(Passage(len(passages), topic, "\n\n".join(chunk)))
                chunk, words = [], 0
        if chunk:
            passages.append(Passage(len(passages), topic, "\n\n".join(chunk)))
    return passages


class Retriever:
    """BM25 over passages; search() returns the top k in ascending passage id."""

    def __init__(self, passages: list[Passage]) -> None:
        self.passages = passages
        self._bm25 = BM25Okapi([tokenize(p.text) for p in passages])

    def search(self, question: str, k: int = 3) -> list[Passage]:
        scores = self._bm25.get_scores(tokenize(question))
        best = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
        return [self.passages[i] for i in sorted(best)]
