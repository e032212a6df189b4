"""lm-eval's logged samples held against the transformers reference.

``--log_samples`` writes one JSON line per document: ``arguments`` holds each request's
arguments (``gen_args_i``: ``arg_0`` the context, ``arg_1`` the continuation or the
generation kwargs) and ``resps`` the model's answer to each, in the same order. lm-eval
stringifies them: a log-likelihood answer is ``[["-4.50", "False"]]``, a generation
``[" 4"]``. The reference (benchmarks/clients/loglik_reference.py) is passed in as plain
callables, so this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoglikRequest:
    """Context + continuation ids as sent; the continuation starts at index ctxlen."""

    tokens: list[int]
    ctxlen: int


@dataclass(frozen=True)
class Loglik:
    """A log-likelihood answer: the continuation's summed log-prob, and whether each of its
    tokens was the most likely one."""

    value: float
    is_greedy: bool


@dataclass(frozen=True)
class LoglikSample:
    """One (context, continuation) request and the served answer lm-eval got for it."""

    task: str
    doc_id: int
    context: str
    continuation: str
    served: Loglik


@dataclass(frozen=True)
class GenSample:
    """One generation request and the text the server returned."""

    task: str
    doc_id: int
    context: str
    max_gen_toks: int
    until: list[str]
    served: str


@dataclass
class LoglikReport:
    compared: int = 0
    max_abs_diff: float = 0.0
    greedy_mismatches: int = 0
    served_greedy: int = 0
    """Requests the server flagged greedy: how often the flag's True side was exercised."""
    worst: dict[str, Any] = field(default_factory=dict)
    """The request with the largest |served - reference|, for the summary."""


@dataclass
class GenReport:
    compared: int = 0
    matches: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)


def _requests(sample: dict[str, Any]) -> list[tuple[dict[str, Any], Any]]:
    """(arguments, first answer) per request of one logged document, in request order."""
    arguments = sample["arguments"]
    ordered = [arguments[f"gen_args_{i}"] for i in range(len(arguments))]
    return [(args, resp[0]) for args, resp in zip(ordered, sample["resps"], strict=True)]


def loglik_samples(task: str, samples: list[dict[str, Any]]) -> list[LoglikSample]:
    return [LoglikSample(task, int(s["doc_id"]), args["arg_0"], args["arg_1"],
                         Loglik(float(resp[0]), str(resp[1]) == "True"))
            for s in samples for args, resp in _requests(s)]


def gen_samples(task: str, samples: list[dict[str, Any]], default_max: int) -> list[GenSample]:
    out = []
    for s in samples:
        for args, resp in _requests(s):
            kwargs = args["arg_1"]
            until = kwargs.get("until") or []
            out.append(GenSample(task, int(s["doc_id"]), args["arg_0"],
                                 int(kwargs.get("max_gen_toks", default_max)),
                                 [until] if isinstance(until, str) else list(until),
                                 str(resp)))
    return out


def compare_loglik(samples: Sequence[LoglikSample], requests: Sequence[dict[str, Any]],
                   reference: Callable[[LoglikRequest], Loglik]) -> LoglikReport:
    """|served - reference| over every sample; ``requests[i]`` is sample i's ids."""
    report = LoglikReport()
    for sample, encoded in zip(samples, requests, strict=True):
        request = LoglikRequest(list(encoded["tokens"]), int(encoded["ctxlen"]))
        expected = reference(request)
        diff = abs(sample.served.value - expected.value)
        report.compared += 1
        report.greedy_mismatches += sample.served.is_greedy != expected.is_greedy
        report.served_greedy += sample.served.is_greedy
        if diff >= report.max_abs_diff:
            report.max_abs_diff = diff
            report.worst = {"task": sample.task, "doc_id": sample.doc_id,
                            "continuation": sample.continuation,
                            "tokens": request.tokens, "ctxlen": request.ctxlen,
                            "served": sample.served.value, "reference": expected.value}
    return report


def compare_generations(samples: Sequence[GenSample], prompts: Sequence[list[int]],
                        reference: Callable[[list[int], int, list[str]], str],
                        eos: str | None) -> GenReport:
    """Served text against greedy transformers text; lm-eval adds the EOS string to the stop
    strings of every request (handle_stop_sequences), so the reference stops there too."""
    report = GenReport()
    for sample, prompt in zip(samples, prompts, strict=True):
        stop = [*sample.until, *([eos] if eos and eos not in sample.until else [])]
        expected = reference(prompt, sample.max_gen_toks, stop)
        report.compared += 1
        if expected == sample.served:
            report.matches += 1
        else:
            report.mismatches.append({"task": sample.task, "doc_id": sample.doc_id,
                                      "served": sample.served, "reference": expected})
    return report
