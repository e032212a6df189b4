"""The RAG workload generator: single-turn requests, conversations, reuse accounting, and
the real-text corpus in the model's chat format."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmarks.rag_workload import RagRequest, RagSpec, make_rag_workload, theoretical_reuse
from benchmarks.serving import assign_adapters, from_workload
from benchmarks.text_corpus import SYSTEM_PROMPT, chat_frame, text_corpus

SMALL = RagSpec(num_requests=40, num_documents=8, doc_len=(16, 48), system_prompt_len=32,
                question_len=(4, 8), output_len=6, vocab_size=512, seed=3)


def test_single_turn_requests_are_independent_and_in_arrival_order() -> None:
    requests = make_rag_workload(SMALL)
    assert len(requests) == 40
    assert [r.session_id for r in requests] == list(range(40))
    assert all(a.arrival_s < b.arrival_s for a, b in pairwise(requests))
    system = requests[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == system for r in requests)
    assert all(list(r.doc_ids) == sorted(r.doc_ids) and len(r.doc_ids) == 3 for r in requests)


@pytest.mark.parametrize("turns", [2, 3, 5])
def test_a_follow_up_extends_its_previous_turn(turns: int) -> None:
    spec = RagSpec(**{**SMALL.__dict__, "turns_per_session": turns})
    requests = make_rag_workload(spec)
    assert len(requests) == 40
    assert all(a.arrival_s <= b.arrival_s for a, b in pairwise(requests))
    by_session: dict[int, list[RagRequest]] = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    assert max(len(turns_seen) for turns_seen in by_session.values()) == turns
    for conversation in by_session.values():
        assert len(conversation) <= turns
        assert len({r.doc_ids for r in conversation}) == 1
        for previous, follow_up in pairwise(conversation):
            grown = len(follow_up.prompt_token_ids) - len(previous.prompt_token_ids)
            assert follow_up.prompt_token_ids[:len(previous.prompt_token_ids)] \
                == previous.prompt_token_ids
            # the stand-in answer (output_len tokens) plus a 4-8 token question
            assert spec.output_len + 4 <= grown <= spec.output_len + 8


def test_one_turn_sessions_keep_the_single_turn_workload() -> None:
    explicit = make_rag_workload(RagSpec(**{**SMALL.__dict__, "turns_per_session": 1}))
    assert explicit == make_rag_workload(SMALL)


def test_turns_must_be_positive() -> None:
    with pytest.raises(ValueError, match="turns_per_session"):
        RagSpec(turns_per_session=0)


def test_theoretical_reuse_counts_only_after_the_warm_up() -> None:
    prompt = list(range(10, 60))  # 50 tokens: 3 full blocks of 16, all 3 may hit (cap 49)
    twice = [RagRequest(prompt, 4, 0.0, ()), RagRequest(prompt, 4, 1.0, ())]
    assert theoretical_reuse(twice, 16) == pytest.approx(48 / 100)
    assert theoretical_reuse(twice, 16, warm=1) == pytest.approx(48 / 50)
    assert theoretical_reuse(twice, 16, warm=2) == 0.0


def test_conversations_keep_one_adapter() -> None:
    rag = make_rag_workload(RagSpec(**{**SMALL.__dict__, "turns_per_session": 3}))
    requests = assign_adapters(from_workload(rag), ["a", "b", "c", "d"], seed=1,
                               sessions=[r.session_id for r in rag])
    adapter_of: dict[int, str | None] = {}
    for source, request in zip(rag, requests, strict=True):
        assert adapter_of.setdefault(source.session_id, request.lora) == request.lora
    assert len(set(adapter_of.values())) > 1


def test_text_corpus_prompts_are_chat_framed_reference_text(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    spec = RagSpec(num_requests=12, num_documents=6, doc_len=(64, 128), seed=2)
    requests = make_rag_workload(spec, text_corpus(tokenizer))
    assert make_rag_workload(spec, text_corpus(tokenizer)) == requests  # seeded
    head, middle, tail = chat_frame(tokenizer)
    assert (head, middle, tail) == ("<|im_start|>system\n", "<|im_end|>\n<|im_start|>user\n",
                                    "<|im_end|>\n<|im_start|>assistant\n")
    texts = [str(tokenizer.decode(r.prompt_token_ids)) for r in requests]
    system = head + SYSTEM_PROMPT + middle
    assert all(t.startswith(system) and t.endswith(tail) for t in texts)
    # the shared prefix is the same token ids in every request, up to the first document
    prefix_len = len(tokenizer(system + "Reference sections:\n\n",
                               add_special_tokens=False)["input_ids"])
    assert len({tuple(r.prompt_token_ids[:prefix_len]) for r in requests}) == 1
    for request, text in zip(requests, texts, strict=True):
        question = text[text.rindex("Question about the section headed '"):]
        heading = question.split("'")[1]
        assert heading in text[:-len(question)]  # asked about a section that is in the prompt
        assert len(request.doc_ids) == 3


def test_text_corpus_follow_ups_extend_the_conversation(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    spec = RagSpec(num_requests=9, num_documents=4, doc_len=(32, 64), turns_per_session=3,
                   seed=1)
    requests = make_rag_workload(spec, text_corpus(tokenizer))
    by_session: dict[int, list[RagRequest]] = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    for conversation in by_session.values():
        for previous, follow_up in pairwise(conversation):
            assert follow_up.prompt_token_ids[:len(previous.prompt_token_ids)] \
                == previous.prompt_token_ids
            grown = follow_up.prompt_token_ids[len(previous.prompt_token_ids):]
            added = str(tokenizer.decode(grown))
            assert added.startswith(" The section says")


def test_text_corpus_refuses_more_documents_than_the_reference_has(
        tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with pytest.raises(ValueError, match="sections of at least"):
        make_rag_workload(RagSpec(num_documents=500), text_corpus(tokenizer))
