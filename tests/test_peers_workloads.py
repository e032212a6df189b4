"""The peer benchmark's workloads and job plan (no vLLM needed): real-text requests of the
asked shapes, deterministic, RAG prefixes shared exactly where documents repeat, and the job
files the runners read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmarks.peers.job import EngineSettings, Job, Phase, read_job
from benchmarks.peers.plan import QUICK, offline_jobs
from benchmarks.peers.workloads import (
    Corpus,
    RagShape,
    mixed_requests,
    rag_requests,
    round_robin_adapters,
    warmup_requests,
    zipf_weights,
)


@pytest.fixture(scope="module")
def tokenize(tiny_model_dir: Path) -> Callable[[str], list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def corpus(tokenize: Callable[[str], list[int]]) -> Corpus:
    return Corpus.load(tokenize)


def test_mixed_requests_are_real_text_slices_in_range_and_seeded(corpus: Corpus) -> None:
    requests = mixed_requests(corpus, 20, (32, 64), (4, 9), seed=5)
    stream = corpus.stream
    text = ",".join(map(str, stream))
    for r in requests:
        assert 32 <= len(r.prompt_token_ids) <= 64 and 4 <= r.output_len <= 9
        assert ",".join(map(str, r.prompt_token_ids)) in text
    assert requests == mixed_requests(corpus, 20, (32, 64), (4, 9), seed=5)
    assert requests != mixed_requests(corpus, 20, (32, 64), (4, 9), seed=6)


def test_rag_requests_share_exactly_their_document(corpus: Corpus,
                                                   tokenize: Callable[[str], list[int]]
                                                   ) -> None:
    shape = RagShape(num_requests=40, num_documents=4, doc_len=200, question_len=12,
                     output_len=5)
    requests, doc_of = rag_requests(corpus, shape, tokenize)
    assert len(requests) == 40 and set(doc_of) <= set(range(4))
    heads = {doc: r.prompt_token_ids[:200] for r, doc in zip(requests, doc_of, strict=True)}
    assert len(set(heads.values())) == len(heads)
    for r, doc in zip(requests, doc_of, strict=True):
        assert r.prompt_token_ids[:200] == heads[doc] and r.output_len == 5
    tails = [r.prompt_token_ids[200:] for r in requests]
    assert len(set(tails)) == 40  # distinct questions
    # Zipf: the most popular document is drawn most often.
    assert max(range(4), key=doc_of.count) == 0


def test_zipf_weights_and_round_robin() -> None:
    assert zipf_weights(3, 1.0) == [1.0, 0.5, 1.0 / 3]
    base = [r for r in warmup_requests(lambda s: [7, 8, 9])] * 5
    assigned = round_robin_adapters(base, ["a", "b"])
    assert [r.lora for r in assigned] == ["a", "b", "a", "b", "a"]
    with pytest.raises(ValueError):
        round_robin_adapters(base, [])


def test_plan_groups_parts_by_settings_and_jobs_round_trip(
        corpus: Corpus, tokenize: Callable[[str], list[int]], tmp_path: Path) -> None:
    adapters = {f"peer-{i}": f"/x/peer-{i}" for i in range(3)}
    jobs = offline_jobs(("agreement", "mixed", "rag", "lora"), QUICK, "/m", corpus,
                        tokenize, adapters, EngineSettings())
    assert [(j.tag, j.parts) for j in jobs] == [("base", ("agreement", "mixed")),
                                               ("rag", ("rag",)), ("lora", ("lora",))]
    base, rag, lora = (j.job for j in jobs)
    assert not base.settings.prefix_caching and rag.settings.prefix_caching
    assert lora.settings.max_loras == 3 and lora.adapters == adapters
    assert all(len(r.prompt_token_ids) and r.output_len == QUICK.agreement_output
               for r in base.phases[1].requests)
    assert [p.timed for p in base.phases] == [False, True, True]
    warm_loras = [r.lora for r in lora.phases[0].requests]
    assert warm_loras == ["peer-0", "peer-1", "peer-2"]
    path = tmp_path / "job.json"
    lora.write(path)
    assert read_job(path) == lora


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        EngineSettings(threads=0)
    with pytest.raises(ValueError):
        EngineSettings(max_loras=-1)
    assert Job("/m", EngineSettings(), (Phase("p", ()),)).to_json()["phases"][0]["timed"]
