"""The compiled span kernel (engine/cpu_kernels/span_attention.cpp): against a torch oracle
item by item, and as cascade attention's executor against the reference paged attention."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from engine import cpu_kernels
from engine.attention import build_attention_metadata, paged_attention
from engine.cascade_attention import CascadeRequest, build_cascade_plan, cascade_available
from engine.cascade_spans import SOURCE_IDS
from engine.cpu_kernels import MARCH_ENV, SpanAttentionOp, load_span_attention
from tests.cascade_batches import random_batch, random_step_tensors
from tests.kernels import compiled_decode_kernel, required

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def span_kernel() -> SpanAttentionOp:
    return required(load_span_attention())


def _oracle(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, diag: int,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D] attends to keys/values [L, Hkv, D] (causal with offset diag >= 0), in
    float64: (out [n, H, D], lse [n, H])."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.matmul(q.double().transpose(0, 1), k.transpose(-1, -2)) * scale
    if diag >= 0:
        seen = torch.arange(keys.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + diag
        scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.matmul(probs, v).transpose(0, 1), lse.transpose(0, 1)


def _merged(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Partials (out [H, D], lse [H]) of one row merged: softmax over their union."""
    outs = torch.stack([o for o, _ in parts])
    lses = torch.stack([lse for _, lse in parts])
    weight = torch.softmax(lses, 0).nan_to_num(0.0)
    return (weight[..., None] * outs).sum(0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
def test_items_and_merge_match_the_oracle(span_kernel: SpanAttentionOp, seed: int,
                                           head_dim: int, heads: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_heads, num_kv_heads = heads
    tokens, block, num_blocks = 90, 16, 24
    q = torch.randn(tokens, num_heads, head_dim, generator=gen)
    # The step's K/V as a strided view (rows of a wider projection), as the model has them.
    qkv = torch.randn(tokens, 3 * num_kv_heads * head_dim, generator=gen)
    k_step = qkv[:, :num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    v_step = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(
        tokens, num_kv_heads, head_dim)
    if seed % 2:  # K normalized into a tensor of its own (Gemma 3), V still a view
        k_step = k_step.contiguous()
    caches = torch.randn(2, num_blocks, block, num_kv_heads, head_dim, generator=gen)
    copies = torch.randn(2, 5, block, num_kv_heads, head_dim, generator=gen)
    flat = {"cache": (caches[0].view(-1, num_kv_heads, head_dim),
                      caches[1].view(-1, num_kv_heads, head_dim)),
            "copy": (copies[0].view(-1, num_kv_heads, head_dim),
                     copies[1].view(-1, num_kv_heads, head_dim)),
            "step": (k_step, v_step)}
    items, rows, expected = [], [], []
    offset = 0
    for _ in range(rng.randint(1, 6)):
        source = rng.choice(list(flat))
        slots = flat[source][0].shape[0]
        key_len = rng.choice([0, 1, rng.randint(2, 31), 32, rng.randint(33, 75)])
        key_len = min(key_len, slots)
        start = rng.randint(0, slots - key_len)
        n = rng.choice([0, 1, rng.randint(2, 40)])
        diag = rng.choice([-1, -1, 0, rng.randint(1, 9)])
        item_rows = torch.tensor([rng.randrange(tokens) for _ in range(n)], dtype=torch.int64)
        keys, values = (x[start:start + key_len] for x in flat[source])
        out, lse = _oracle(q[item_rows], keys, values, diag, 0.3)
        items.append((SOURCE_IDS[source], start, key_len, offset, n, diag))
        rows.append(item_rows)
        expected += list(zip(item_rows.tolist(), out, lse, strict=True))
        offset += n
    # Prior partials (as the decode kernel returns them) for a few rows.
    num_prior = rng.randint(0, 4)
    prior_rows = [rng.randrange(tokens) for _ in range(num_prior)]
    prior_out = torch.randn(num_prior, num_heads, head_dim, generator=gen)
    prior_lse = torch.randn(num_prior, num_heads, generator=gen) * 5
    every = prior_rows + [r for r, _, _ in expected]
    partials = [(o.double(), lse.double()) for o, lse in zip(prior_out, prior_lse, strict=True)]
    partials += [(o, lse) for _, o, lse in expected]
    num_rows = tokens
    order = sorted(range(len(every)), key=lambda i: every[i])
    offsets = [0]
    for r in range(num_rows):
        offsets.append(offsets[-1] + every.count(r))
    out = span_kernel(q, caches[0], caches[1], copies[0], copies[1], k_step, v_step,
                      torch.tensor(items, dtype=torch.int64).reshape(-1, 6),
                      torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64),
                      prior_out, prior_lse, torch.tensor(offsets), torch.tensor(order), 0.3)
    assert out.shape == (num_rows, num_heads, head_dim) and out.dtype == torch.float32
    for r in range(num_rows):
        mine = [partials[i] for i in order[offsets[r]:offsets[r + 1]]]
        want = _merged(mine) if mine else torch.zeros(num_heads, head_dim, dtype=torch.float64)
        torch.testing.assert_close(out[r].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not cascade_available(CPU), reason="torch lacks the CPU flash op")
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("shape", [(4, 4, 64, 16), (9, 3, 64, 32), (8, 2, 128, 16),
                                   (4, 1, 32, 8)])
@pytest.mark.parametrize("private_tails", ["torch", "compiled"])
def test_cascade_through_the_kernel_matches_reference(span_kernel: SpanAttentionOp, seed: int,
                                                      shape: tuple[int, int, int, int],
                                                      private_tails: str) -> None:
    kernel = compiled_decode_kernel() if private_tails == "compiled" else None
    num_heads, num_kv_heads, head_dim, block = shape
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 800 // block * 4
    decodes, prefills = random_batch(rng, num_blocks, block, shared_pool=36,
                                     length_scale=96 // block)
    q, k, v, caches = random_step_tensors(decodes, prefills, num_heads, num_kv_heads, head_dim,
                                          block, num_blocks)
    ref_meta = build_attention_metadata(decodes, prefills, block, None, CPU)
    meta = build_attention_metadata(decodes, prefills, block, None, CPU, cascade=True,
                                    kernel=kernel, span_kernel=span_kernel)
    assert meta.cascade is not None and meta.cascade.spans is not None
    ref_caches, span_caches = caches.clone(), caches.clone()
    ref = paged_attention(q, k, v, ref_caches[0], ref_caches[1], ref_meta, 0.2)
    out = paged_attention(q, k, v, span_caches[0], span_caches[1], meta, 0.2)
    assert torch.equal(ref_caches, span_caches)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)


def test_the_plan_has_an_item_per_node_span_and_per_chunk(span_kernel: SpanAttentionOp) -> None:
    # Two decodes share blocks 0-2 (read in place) with a 5-row chunk after 13 cached
    # positions; the decodes' private blocks are batched tails of the decode kernel, the
    # chunk's block 12 is a one-block copy; the chunk is one causal item over its own K/V,
    # not pieces.
    requests = [
        CascadeRequest([0, 1, 2, 10], 14, 0, 1, fresh=False),
        CascadeRequest([0, 1, 2, 11], 15, 1, 1, fresh=False),
        CascadeRequest([0, 1, 2, 12, 13], 13, 2, 5, fresh=True),
    ]
    plan = build_cascade_plan(requests, 4, CPU, kernel=compiled_decode_kernel(),
                              span_kernel=span_kernel)
    assert plan.spans is not None and len(plan.private) == 1
    assert sorted(tuple(i[:3] + i[4:]) for i in plan.spans.items.tolist()) == [
        (0, 0, 12, 7, -1),  # blocks 0-2 in place for all seven rows
        (1, 0, 1, 5, -1),   # the chunk's copied block 12, one cached position
        (2, 2, 5, 5, 0),    # the chunk over its own K/V, causally
    ]
    # Each row's partials: both decodes a tail and the shared node; chunk rows three each.
    assert plan.spans.merge_offsets.diff().tolist() == [2, 2, 3, 3, 3, 3, 3]
    assert plan.spans.merge_parts[:1].tolist() in ([0], [1])  # row 0's tail comes first


def test_bad_items_are_refused(span_kernel: SpanAttentionOp) -> None:
    q = torch.randn(4, 2, 32)
    cache = torch.randn(3, 4, 2, 32)
    step = torch.randn(4, 2, 32)
    empty_out, empty_lse = torch.empty(0, 2, 32), torch.empty(0, 2)

    def run(items: list[int], rows: list[int]) -> torch.Tensor:
        return span_kernel(q, cache, cache, cache[:0], cache[:0], step, step,
                           torch.tensor([items]), torch.tensor(rows), empty_out, empty_lse,
                           torch.tensor([0, 0, 0, 0, 0]), torch.empty(0, dtype=torch.int64),
                           0.1)

    with pytest.raises(RuntimeError, match="keys are out of range"):
        run([0, 10, 3, 0, 1, -1], [0])  # slots 10-12 of 12
    with pytest.raises(RuntimeError, match="keys are out of range"):
        run([2, 2, 3, 0, 1, -1], [0])  # step rows 2-4 of 4
    with pytest.raises(RuntimeError, match="bad item source"):
        run([3, 0, 1, 0, 1, -1], [0])
    with pytest.raises(RuntimeError, match="a row is out of range"):
        run([0, 0, 1, 0, 1, -1], [4])
    with pytest.raises(RuntimeError, match="rows are out of range"):
        run([0, 0, 1, 0, 2, -1], [0])
    assert run([0, 0, 12, 0, 1, -1], [3]).abs().sum() == 0  # no merge parts: zeros


def test_the_kernel_runs_on_the_widest_vectors_the_target_has() -> None:
    # Built for AVX2 (LORAGATE_CPU_MARCH=haswell, test_cpu_kernels_avx2.py) the kernels use
    # 8-float vectors; a build without 8-float vectors keeps torch's flash path instead.
    required(load_span_attention())
    width = torch.ops.loragate.vector_width()
    if os.environ.get(MARCH_ENV) == "haswell":
        assert width == 8
    elif "avx512f" in Path("/proc/cpuinfo").read_text() and not os.environ.get(MARCH_ENV):
        assert width == 16
    assert width >= 8


def test_narrow_vectors_keep_the_flash_path(monkeypatch: pytest.MonkeyPatch) -> None:
    required(load_span_attention())
    monkeypatch.setattr(cpu_kernels, "_MIN_SPAN_VECTOR_WIDTH", 32)
    assert load_span_attention() is None
