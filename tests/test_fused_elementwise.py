"""The compiled fused element-wise ops against the eager ops they replace (engine/models/
llama.py, written after transformers' Llama): RMSNorm, residual add + RMSNorm, rope in place
on views into the fused QKV output, SiLU-and-multiply; float32, bfloat16 and float16; strided
rows; argument checks; and a whole model's hidden states with and without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import build_step_metadata
from engine.models.llama import RMSNorm, apply_rope
from engine.models.loader import load_hf_config, load_model
from tests.kernels import compiled_fused_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32: summation order and exp's last bits; half types: one rounding of the result.
    tol = 1e-5 if want.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _norm(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5)
    torch.manual_seed(seed)
    norm.weight.data = torch.randn(dim).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm_and_add_rms_norm_match_eager(dtype: torch.dtype, tokens: int) -> None:
    ops = compiled_fused_ops()
    hidden = 96
    norm = _norm(hidden, dtype, tokens)
    wide = (torch.randn(tokens, hidden + 32) * 3).to(dtype)
    x = wide[:, 8:8 + hidden]  # rows with a stride wider than the row
    residual = torch.randn(tokens, hidden).to(dtype)
    _close(ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    out, total = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(total, x + residual)  # the add rounds as torch's does
    _close(out, norm(x + residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128)])
def test_rotary_in_place_matches_eager(dtype: torch.dtype, heads: int, kv_heads: int,
                                       head_dim: int) -> None:
    ops = compiled_fused_ops()
    tokens = 11
    torch.manual_seed(heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 50
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].to(dtype)  # [T, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].to(dtype)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), -1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    want_q, want_k = apply_rope(q, k, cos, sin)
    v_before = v.clone()
    ops.rotary_(q, k, cos, sin)  # views into qkv: rotated where they lie
    _close(q, want_q)
    _close(k, want_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_eager(dtype: torch.dtype) -> None:
    ops = compiled_fused_ops()
    inter = 72
    gate_up = (torch.randn(33, 2 * inter) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # exp's clamps
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    _close(ops.silu_and_mul(gate_up), want)


def test_fused_ops_refuse_bad_arguments() -> None:
    ops = compiled_fused_ops()
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.rms_norm(torch.zeros(8, 4).t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.float64), weight, 1e-5)
    with pytest.raises(RuntimeError, match="residual must be like x"):
        ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), weight, 1e-5)
    with pytest.raises(RuntimeError, match="even D"):
        ops.rotary_(torch.zeros(2, 1, 3), torch.zeros(2, 1, 3), torch.zeros(2, 3),
                    torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="2I"):
        ops.silu_and_mul(torch.zeros(2, 7))


def test_model_hidden_states_with_and_without_fused_ops(tiny_model_dir: Path) -> None:
    ops = compiled_fused_ops()
    model = load_model(str(tiny_model_dir), load_hf_config(str(tiny_model_dir)), torch.float32,
                       torch.device("cpu"), max_positions=256)
    shape = model.shape
    tokens = 40
    block = 16
    caches = [(torch.zeros(8, block, shape.num_kv_heads, shape.head_dim),
               torch.zeros(8, block, shape.num_kv_heads, shape.head_dim))
              for _ in range(shape.num_layers)]
    metas = build_step_metadata([], [(list(range(8)), 0, tokens)], block, shape.layer_windows,
                                torch.device("cpu"))
    ids = torch.randint(0, shape.vocab_size, (tokens,))
    positions = torch.arange(tokens)
    with torch.inference_mode():
        eager = model(ids, positions, [(k.clone(), v.clone()) for k, v in caches], metas)
        model.use_fused_ops(ops)
        fused = model(ids, positions, [(k.clone(), v.clone()) for k, v in caches], metas)
        model.use_fused_ops(None)
        again = model(ids, positions, [(k.clone(), v.clone()) for k, v in caches], metas)
    torch.testing.assert_close(fused, eager, atol=1e-4, rtol=1e-4)
    assert not torch.equal(fused, torch.zeros_like(fused))
    assert torch.equal(again, eager)
