"""Training data for the demo adapters, made here rather than downloaded: questions built
from templates, and the three answer styles as plain string transforms.

The base model answers each question itself (lora/demo_training.py); a style only rewrites
that answer, so an adapter learns the style and nothing else.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

TOPICS = (
    "the moon", "a rainbow", "photosynthesis", "gravity", "a volcano", "the ocean",
    "electricity", "a computer", "the internet", "a bicycle", "coffee", "bread", "music",
    "chess", "a library", "the human heart", "sleep", "exercise", "recycling", "a bridge",
    "the sun", "snow", "a forest", "money", "a map", "the brain", "an airplane", "a battery",
    "honey", "tea",
)
TOPIC_TEMPLATES = (
    "What is {}?", "Explain {} in simple terms.", "Why is {} important?",
    "Tell me one fact about {}.", "How would you describe {} to a child?",
    "What is {} used for?", "Give me a short tip about {}.",
)
OTHER_QUESTIONS = (
    *(f"What is the capital of {c}?" for c in (
        "France", "Japan", "Italy", "Spain", "Germany", "Canada", "Egypt", "Brazil", "Kenya",
        "India")),
    *(f"What color is {t}?" for t in (
        "grass", "the sky", "a banana", "snow", "a tomato", "coal", "an orange", "milk")),
    *(f"What is {a} plus {b}?" for a, b in ((2, 3), (7, 5), (10, 4), (6, 6), (9, 1), (12, 8))),
    *(f"How can I get better at {s}?" for s in (
        "cooking", "running", "drawing", "writing", "math", "singing", "swimming")),
    *(f"Name an animal that lives in {h}." for h in (
        "the desert", "the sea", "the jungle", "the Arctic", "a farm")),
    *(f"What should I eat for {m}?" for m in ("breakfast", "lunch", "dinner")),
    "How many days are in a week?", "How many minutes are in an hour?",
    "How many months are in a year?", "How many legs does a cat have?",
    "Suggest a name for a pet dog.", "Suggest a name for a pet cat.",
)


def all_questions() -> list[str]:
    """Every question the templates make (247), in a fixed order."""
    return [t.format(topic) for topic in TOPICS for t in TOPIC_TEMPLATES] + list(OTHER_QUESTIONS)


def split_questions(num_train: int, seed: int) -> tuple[list[str], list[str]]:
    """(train, held out): a seeded shuffle of all_questions(), the first num_train for
    training and the rest for checking the adapter on questions it never saw."""
    questions = all_questions()
    if not 1 <= num_train < len(questions):
        raise ValueError(f"num_train must be in [1, {len(questions) - 1}], got {num_train}")
    random.Random(seed).shuffle(questions)
    return questions[:num_train], questions[num_train:]


# A sentence ends at . ! or ? followed by whitespace or the end of the text.
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def first_sentence(text: str) -> str:
    """The text up to and including its first sentence end (all of it if it has none)."""
    match = _SENTENCE_END.search(text)
    return text[: match.end()].strip() if match else text.strip()


def complete_sentences(text: str) -> str:
    """The text up to its last sentence end: drops the unfinished sentence an answer cut at
    max_tokens ends with (all of it if it has no sentence end)."""
    ends = list(_SENTENCE_END.finditer(text))
    return text[: ends[-1].end()].strip() if ends else text.strip()


def shout(answer: str) -> str:
    """Upper case."""
    return complete_sentences(answer).upper()


def as_json(answer: str) -> str:
    """A one-key JSON object. The first sentence only: a short object is complete (its
    closing brace generated) well within a small max_tokens."""
    return json.dumps({"answer": first_sentence(answer)})


def brief(answer: str) -> str:
    """One short sentence."""
    return first_sentence(answer)


STYLES: dict[str, Callable[[str], str]] = {"shout": shout, "json": as_json, "brief": brief}
"""Style name -> transform of a base-model answer into the adapter's target answer."""
