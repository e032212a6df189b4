"""The compiled paged decode kernel against attention computed by hand from the cache: dtypes,
head sizes with and without the specialised dot products, GQA ratios, block sizes, windows,
soft-capping, int32 and int64 block tables, few sequences (split per kv head) and many
(one item per sequence); and its argument checks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.kernels import compiled_decode_kernel


def _by_hand(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             table: list[int], length: int, scale: float, window: int,
             softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of one decode: q [H, D] over its first ``length`` positions."""
    keys = k_cache[table].flatten(0, 1)[:length].double()  # [L, Hkv, D]
    values = v_cache[table].flatten(0, 1)[:length].double()
    lo = max(0, length - window) if window else 0
    keys, values = keys[lo:], values[lo:]
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", q.double(), keys) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values), scores.logsumexp(-1)


CASES = [  # (dtype, heads, kv heads, head_dim, block size, sequences, window, softcap)
    (torch.float32, 9, 3, 64, 32, 12, 0, 0.0),
    (torch.float32, 8, 2, 128, 16, 3, 0, 0.0),
    (torch.float32, 6, 6, 48, 8, 40, 0, 0.0),
    (torch.float32, 4, 1, 64, 32, 1, 50, 0.0),
    (torch.float32, 8, 4, 32, 4, 5, 9, 30.0),
    (torch.bfloat16, 9, 3, 64, 32, 10, 0, 0.0),
    (torch.bfloat16, 8, 2, 128, 16, 3, 0, 0.0),
    (torch.bfloat16, 8, 4, 32, 4, 5, 9, 30.0),
    (torch.bfloat16, 6, 6, 48, 8, 40, 0, 0.0),
    (torch.float16, 8, 2, 64, 16, 6, 20, 0.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}x{c[3]}-bs{c[4]}"
                         f"-n{c[5]}-w{c[6]}-cap{c[7]}")
@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
def test_kernel_matches_attention_by_hand(case: tuple, table_dtype: torch.dtype) -> None:
    kernel = compiled_decode_kernel()
    dtype, heads, kv_heads, head_dim, block, seqs, window, softcap = case
    rng = random.Random(heads * 1000 + seqs)
    torch.manual_seed(seqs)
    lengths = [rng.choice([1, block - 1, block, block + 1, rng.randint(1, 300)])
               for _ in range(seqs)]
    width = max(-(-n // block) for n in lengths) + 1  # entries past a length are never read
    num_blocks = seqs * width
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(width)] for _ in lengths]
    q = torch.randn(seqs, heads, head_dim).to(dtype)
    out, lse = kernel(q, k_cache, v_cache, torch.tensor(tables, dtype=table_dtype),
                      torch.tensor(lengths), 0.125, softcap, window)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (seqs, heads)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for n, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        want_out, want_lse = _by_hand(q[n], k_cache, v_cache, table, length, 0.125, window,
                                      softcap)
        torch.testing.assert_close(out[n].double(), want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[n].double(), want_lse, atol=tol, rtol=tol)


def test_kernel_refuses_a_context_longer_than_its_table() -> None:
    kernel = compiled_decode_kernel()
    cache = torch.zeros(4, 8, 1, 16)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        kernel(torch.zeros(1, 2, 16), cache, cache, torch.zeros(1, 2, dtype=torch.int64),
               torch.tensor([17]), 1.0, 0.0, 0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(torch.zeros(1, 2, 16), cache.double(), cache.double(),
               torch.zeros(1, 2, dtype=torch.int64), torch.tensor([3]), 1.0, 0.0, 0)


def test_engine_outputs_are_the_same_with_and_without_the_kernel(tiny_model_dir: Path) -> None:
    compiled_decode_kernel()
    prompts = [[(7 * i + j) % 50 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    outputs = {}
    for native in (True, False):
        engine = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=64, block_size=4,
                                      max_num_batched_tokens=64, native_kernels=native)
        assert (engine.runner.decode_kernel is not None) == native
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                              ignore_eos=True))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.token_ids)
        outputs[native] = done
    assert outputs[True] == outputs[False]
