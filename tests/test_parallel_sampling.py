"""n sequences of one prompt run as n engine requests that share the prompt's KV blocks
through the prefix cache (as vLLM's V1 engine does parallel sampling): the first computes
the prompt, the others wait for its blocks and take them; every full prompt block is then
held by all n (its reference count is n) and only the partial last block is each one's own.
"""

from __future__ import annotations

import random
from pathlib import Path

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_sequences_of_one_prompt_share_its_full_blocks(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=64, block_size=16,
                                  max_num_batched_tokens=64, prefix_caching="on")
    rng = random.Random(0)
    prompt = [rng.randrange(5, 500) for _ in range(100)]  # 6 full blocks + 4 tokens
    n = 4
    for j in range(n):
        engine.add_request(f"s{j}", prompt, SamplingParams(max_tokens=8, temperature=1.0,
                                                           seed=j, ignore_eos=True))
    computed_before = engine.stats().prompt_tokens_computed
    while len([r for r in engine.scheduler.running if r.output_token_ids]) < n:
        engine.step()
    tables = [engine.kv.block_table(f"s{j}") for j in range(n)]
    full = len(prompt) // 16
    shared = tables[0][:full]
    assert all(t[:full] == shared for t in tables)
    assert [engine.kv.pool.ref_count(b) for b in shared] == [n] * full
    # Each has its own partial last block (written by its own prefill of those 4 tokens).
    assert len({t[full] for t in tables}) == n
    # The prompt ran once, plus the partial block's tokens once per other sequence.
    computed = engine.stats().prompt_tokens_computed - computed_before
    assert computed <= len(prompt) + (n - 1) * (len(prompt) - full * 16) + n
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert len({tuple(ids) for ids in outputs.values()}) > 1  # sampled independently
    engine.step()
    assert engine.stats().kv_blocks_used == 0
