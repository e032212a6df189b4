"""Prepacked oneDNN GEMMs (lora/cpu_gemm.py): same results as F.linear, and an engine that
loads its weights packed serves what the plain one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.llm_engine import LLMEngine
from lora.cpu_gemm import linear, native_bf16, prepack, prepack_supported
from tests.parity import random_workload, run_workload

pytestmark = pytest.mark.skipif(not prepack_supported(torch.zeros(1, 1)),
                                reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 133])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 72, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 144, generator=gen)[:, ::2]       # strided rows and columns too
    packed = prepack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape and packed.dtype == torch.float32
    torch.testing.assert_close(linear(x, packed, b), F.linear(x, weight, b), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(linear(x, weight, b), F.linear(x, weight, b))  # plain: F.linear


def test_float16_and_packed_weights_are_not_packed() -> None:
    assert not prepack_supported(torch.zeros(2, 2, dtype=torch.float16))
    assert not prepack_supported(prepack(torch.zeros(2, 2)))


def test_bfloat16_weights_are_packed_only_with_amx() -> None:
    weight = torch.randn(96, 72).bfloat16()
    assert prepack_supported(weight) == native_bf16()
    if not native_bf16():
        pytest.skip("this CPU has no AMX: bfloat16 weights stay plain")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 144, generator=gen).bfloat16()[:, ::2]
    bias = torch.randn(96, generator=gen).bfloat16()
    packed = prepack(weight)
    assert packed.is_mkldnn and packed.dtype == torch.bfloat16
    # One bf16 rounding of float32 sums accumulated in another order, at most.
    torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias),
                               rtol=1e-2, atol=1e-2)


def test_packed_engine_serves_what_the_plain_one_does(tiny_model_dir: Path) -> None:
    engines = [LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=64,
                                    max_num_batched_tokens=64, prepack_weights=packed)
               for packed in (False, True)]
    plain, packed = (e.runner.model for e in engines)
    linears = [m for m in packed.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    assert not any(m.weight.is_mkldnn for m in plain.modules() if isinstance(m, nn.Linear))
    # A tied LM head gets a packed copy; the embedding keeps the plain weight.
    assert not packed.model.embed_tokens.weight.is_mkldnn
    items = random_workload(6, seed=3, max_prompt=90, max_output=8)
    outputs = [run_workload(engine, items) for engine in engines]
    for item in items:
        a, b = (out[item.request_id] for out in outputs)
        assert a.token_ids == b.token_ids
        for lp_a, lp_b in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert lp_a.keys() == lp_b.keys()
            for token, value in lp_a.items():
                assert abs(value - lp_b[token]) < 1e-4
