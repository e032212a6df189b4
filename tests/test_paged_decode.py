"""Batched decode attention equals attention over each decode's context computed by hand,
with a sliding window, with soft-capping, and through the reference paged attention; the
torch path (copies into buffers) and the compiled kernel (engine/cpu_kernels) alike."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import build_attention_metadata, paged_attention
from engine.cpu_kernels import PagedDecodeOp
from engine.paged_decode import (
    CopyBuffers,
    DecodeBatch,
    build_decode_batch,
    build_decode_batches,
    decode_attention,
)
from tests.kernels import compiled_decode_kernel

CPU = torch.device("cpu")
BLOCK = 4


def _by_hand(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             table: list[int], length: int, scale: float, window: int | None,
             softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode: its context copied out, each query head against its KV head."""
    keys = k_cache[table].flatten(0, 1)[:length]  # [L, Hkv, D]
    values = v_cache[table].flatten(0, 1)[:length]
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", q, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if window is not None:
        scores[:, :max(0, length - window)] = float("-inf")
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values), scores.logsumexp(-1)


def _kernel(name: str) -> PagedDecodeOp | None:
    return compiled_decode_kernel() if name == "compiled" else None


@pytest.mark.parametrize("path", ["torch", "compiled"])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 3.0)])
def test_batched_decodes_match_attention_by_hand(seed: int, window: int | None,
                                                 softcap: float | None, path: str) -> None:
    kernel = _kernel(path)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads, head_dim = rng.choice([(4, 4, 16), (6, 2, 8), (9, 3, 64),
                                                    (8, 2, 128)])
    num_blocks = 60
    k_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim)
    free = list(range(num_blocks))
    rng.shuffle(free)
    decodes = []  # rows out of order, lengths from one position to several blocks
    for row in rng.sample(range(12), rng.choice([1, 3, 7])):
        length = rng.randint(1, 22)
        # A longer table than the length needs: entries past it must not be read.
        decodes.append((row, [free.pop() for _ in range(-(-length // BLOCK) + 1)], length))
    q = torch.randn(12, num_heads, head_dim)
    batch = build_decode_batch(decodes, BLOCK, CPU, window, kernel=kernel)
    out, lse = decode_attention(q, k_cache, v_cache, batch, 0.3, softcap)
    assert out.shape == (len(decodes), num_heads, head_dim)
    # The torch path has no log-sum-exp when soft-capping; the kernel always returns one.
    assert (lse is None) == (softcap is not None and kernel is None)
    for i, (row, table, length) in enumerate(decodes):
        want_out, want_lse = _by_hand(q[row], k_cache, v_cache, table, length, 0.3, window,
                                      softcap)
        torch.testing.assert_close(out[i], want_out, atol=1e-5, rtol=1e-4)
        if lse is not None:
            torch.testing.assert_close(lse[i], want_lse, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("path", ["torch", "compiled"])
@pytest.mark.parametrize("window", [None, 6])
def test_reference_paged_attention_runs_decodes_batched(window: int | None, path: str) -> None:
    kernel = _kernel(path)
    rng = random.Random(7)
    torch.manual_seed(7)
    num_blocks = 60
    free = list(range(num_blocks))
    rng.shuffle(free)
    decodes = []
    for _ in range(5):
        length = rng.randint(1, 30)
        decodes.append(([free.pop() for _ in range(-(-length // BLOCK))], length))
    prefills = [([free.pop() for _ in range(3)], 4, 7)]
    q, k, v = torch.randn(12, 8, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    k_cache, v_cache = torch.randn(2, num_blocks, BLOCK, 2, 16)
    meta = build_attention_metadata(decodes, prefills, BLOCK, window, CPU, kernel=kernel)
    assert len(meta.decodes) == 1 or kernel is None  # the kernel takes any lengths at once
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    for row, (table, length) in enumerate(decodes):
        # The step's own K/V went to the cache first: position length-1 holds k[row].
        want, _ = _by_hand(q[row], k_cache, v_cache, table, length, 0.25, window, None)
        torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-4)


def test_copy_buffers_are_reused_across_calls_and_grow_on_demand() -> None:
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(2, 20, BLOCK, 2, 8)
    q = torch.randn(3, 4, 8)
    buffers = CopyBuffers()
    small = build_decode_batch([(0, [3], 2), (2, [5, 6], 7)], BLOCK, CPU, buffers=buffers)
    large = build_decode_batch([(0, [1, 2, 3], 11), (1, [7, 8, 9, 10], 16), (2, [4], 3)],
                               BLOCK, CPU, buffers=buffers)
    for batch in (small, large, small):
        got, _ = decode_attention(q, k_cache, v_cache, batch, 0.5)
        unbuffered = DecodeBatch(batch.rows, batch.block_tables, batch.bias)
        want, _ = decode_attention(q, k_cache, v_cache, unbuffered, 0.5)
        assert torch.equal(got, want)
    keys, _ = buffers.take((4, BLOCK, 2, 8), k_cache)
    again, _ = buffers.take((2, BLOCK, 2, 8), k_cache)
    assert keys.data_ptr() == again.data_ptr()  # a smaller take reuses the space
    grown, _ = buffers.take((40, BLOCK, 2, 8), k_cache)
    assert grown.numel() == 40 * BLOCK * 2 * 8


def test_decodes_of_very_different_lengths_are_cut_into_batches() -> None:
    # 24 short contexts (1-2 blocks) and 8 long ones (40 blocks): padding every short one to
    # 40 blocks would cost far more than a second call; similar lengths stay together.
    rng = random.Random(2)
    lengths = [rng.randint(1, 8) for _ in range(24)] + [rng.randint(157, 160) for _ in range(8)]
    rng.shuffle(lengths)
    decodes = [(row, list(range(-(-n // BLOCK))), n) for row, n in enumerate(lengths)]
    batches = build_decode_batches(decodes, BLOCK, CPU)
    assert [b.rows.numel() for b in batches] == [8, 24]
    assert sorted(torch.cat([b.rows for b in batches]).tolist()) == list(range(32))
    assert [b.block_tables.shape[1] for b in batches] == [40, 2]
    even = [(row, [0, 1, 2], 9 + row % 3) for row in range(6)]
    assert len(build_decode_batches(even, BLOCK, CPU)) == 1
    assert build_decode_batches([], BLOCK, CPU) == []
