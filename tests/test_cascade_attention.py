"""Cascade attention equals the reference paged attention on batches that share blocks."""

from __future__ import annotations

import random

import pytest
import torch

from engine import cascade_attention
from engine.attention import build_attention_metadata, paged_attention
from engine.cascade_attention import (
    CascadeRequest,
    KeySpan,
    build_cascade_plan,
    cascade_available,
)
from tests.cascade_batches import random_batch, random_step_tensors
from tests.kernels import compiled_decode_kernel

BLOCK = 4
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(not cascade_available(CPU), reason="torch lacks the CPU flash op")


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("piece_rows", [128, 3])
@pytest.mark.parametrize("private_tails", ["torch", "compiled"])
def test_cascade_matches_reference(seed: int, heads: tuple[int, int], piece_rows: int,
                                   private_tails: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = compiled_decode_kernel() if private_tails == "compiled" else None
    # 3-row pieces split most of the 2-9-row chunks: earlier pieces' keys become a node.
    monkeypatch.setattr(cascade_attention, "FRESH_PIECE_ROWS", piece_rows)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads = heads
    head_dim, num_blocks = 16, 200
    decodes, prefills = random_batch(rng, num_blocks, BLOCK, shared_pool=24)
    q, k, v, caches = random_step_tensors(decodes, prefills, num_heads, num_kv_heads, head_dim,
                                          BLOCK, num_blocks)
    ref_meta = build_attention_metadata(decodes, prefills, BLOCK, None, CPU)
    cas_meta = build_attention_metadata(decodes, prefills, BLOCK, None, CPU, cascade=True,
                                        kernel=kernel)
    assert ref_meta.cascade is None and cas_meta.cascade is not None
    # Every decode has at least one private block (its last): a batched tail each.
    private = cas_meta.cascade.private
    assert sum(batch.rows.numel() for batch in private) == len(decodes)
    assert torch.equal(ref_meta.slot_mapping, cas_meta.slot_mapping)
    ref_caches, cas_caches = caches.clone(), caches.clone()
    ref = paged_attention(q, k, v, ref_caches[0], ref_caches[1], ref_meta, 0.25)
    out = paged_attention(q, k, v, cas_caches[0], cas_caches[1], cas_meta, 0.25)
    assert torch.equal(ref_caches, cas_caches)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_shared_blocks_are_read_once() -> None:
    # Three requests share blocks 0-2 (consecutive: read in place); two of them also share
    # block 3 (a lone block: copied out); 10, 11 and 12 are private partial blocks, and the
    # two decodes' private tails (10, 11) are one batched call, not nodes.
    requests = [
        CascadeRequest([0, 1, 2, 3, 10], 18, 0, 1, fresh=False),
        CascadeRequest([0, 1, 2, 3, 11], 20, 1, 1, fresh=False),
        CascadeRequest([0, 1, 2, 12, 13], 13, 2, 5, fresh=True),
    ]
    plan = build_cascade_plan(requests, BLOCK, CPU)
    gathered = plan.gather_blocks.tolist()

    def blocks(span: KeySpan) -> list[int]:
        first, last = span.start // BLOCK, -(-(span.start + span.length) // BLOCK)
        return list(range(first, last)) if span.source == "cache" else gathered[first:last]

    nodes = sorted((sorted(n.query_rows.tolist()),
                    [(blocks(s), s.source == "cache", s.length) for s in n.spans])
                   for n in plan.nodes)
    assert nodes == [
        ([0, 1], [([3], False, 4)]),
        ([0, 1, 2, 3, 4, 5, 6], [([0, 1, 2], True, 12)]),
        ([2, 3, 4, 5, 6], [([12], False, 1)]),
    ]
    assert sorted(plan.gather_blocks.tolist()) == [3, 12]
    assert plan.fresh == [(2, 5)]
    [private] = plan.private
    tails = sorted(zip(private.rows.tolist(), private.block_tables.tolist(),
                       (private.bias[:, 0, 0] == 0).sum(1).tolist(), strict=True))
    assert tails == [(0, [10], 2), (1, [11], 4)]
    assert plan.merge_rows[:2].tolist() == private.rows.tolist()


def test_a_long_chunk_runs_in_pieces_over_its_earlier_rows() -> None:
    # Rows 2-6 are one 5-row chunk after 4 cached positions: pieces of 2 rows; pieces 2 and
    # 3 read rows 2-3 and 2-5 of the step's own K/V without a mask, each piece its own rows
    # causally, and all five rows the cached block (one node, a one-block copy).
    plan = build_cascade_plan([CascadeRequest([0, 1], 4, 2, 5, fresh=True)], BLOCK, CPU,
                              fresh_piece_rows=2)
    assert plan.fresh == [(2, 2), (4, 2), (6, 1)] and plan.whole == []
    assert [(n.query_rows.tolist(), n.spans) for n in plan.nodes] == [
        ([2, 3, 4, 5, 6], [KeySpan("copy", 0, 4)]),
        ([4, 5], [KeySpan("step", 2, 2)]), ([6], [KeySpan("step", 2, 4)])]
    assert plan.merge_rows.tolist() == [2, 3, 4, 5, 6, 4, 5, 6, 2, 3, 4, 5, 6]


def test_a_first_chunk_is_one_call_outside_the_merge() -> None:
    # No cached context: nothing to merge with, so no pieces, no nodes, no merge rows.
    plan = build_cascade_plan([CascadeRequest([0, 1], 0, 2, 5, fresh=True)], BLOCK, CPU,
                              fresh_piece_rows=2)
    assert plan.whole == [(2, 5)] and plan.fresh == [] and plan.nodes == []
    assert plan.merge_rows.numel() == 0


def test_sliding_window_keeps_the_reference_path() -> None:
    meta = build_attention_metadata([([0, 1], 6)], [], BLOCK, 4, CPU, cascade=True)
    assert meta.cascade is None and len(meta.decodes) == 1


def test_the_merge_weighs_each_rows_partials_by_their_log_sum_exp() -> None:
    from engine.cascade_attention import _merge

    gen = torch.Generator().manual_seed(7)
    num_rows, heads, dim = 9, 3, 8
    # Rows 0..8 with 0-4 partials each, out of order; row 5 has none (a whole chunk's row).
    rows = torch.tensor([3, 0, 3, 8, 1, 3, 0, 7, 2, 3, 4, 6, 8, 1])
    outs = torch.randn(len(rows), heads, dim, generator=gen)
    lses = torch.randn(len(rows), heads, generator=gen) * 20  # far apart: the max matters
    merged = _merge(outs, lses, rows, num_rows, torch.float32)
    for row in range(num_rows):
        mine = (rows == row).nonzero().flatten()
        if len(mine) == 0:
            continue
        weight = torch.softmax(lses[mine].double(), dim=0)  # [k, H]
        expected = (weight[..., None] * outs[mine].double()).sum(0)
        torch.testing.assert_close(merged[row].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("private_tails", ["torch", "compiled"])
def test_decodes_that_share_nothing_skip_the_merge(dtype: torch.dtype, private_tails: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes over blocks of their own beside first chunks (a step without prefix hits):
    each decode row's one partial result is its output, put in place without a merge."""
    kernel = compiled_decode_kernel() if private_tails == "compiled" else None
    rng = random.Random(5)
    torch.manual_seed(5)
    free = list(range(60))
    rng.shuffle(free)
    decodes = []
    for length in (1, 4, 5, 17, 30):
        table = [free.pop() for _ in range(-(-length // BLOCK))]
        decodes.append((table, length))
    prefills = [([free.pop() for _ in range(3)], 0, 9), ([free.pop()], 0, 2)]
    q, k, v, caches = (t.to(dtype) for t in random_step_tensors(
        decodes, prefills, 8, 2, 16, BLOCK, 60))
    ref_meta = build_attention_metadata(decodes, prefills, BLOCK, None, CPU)
    cas_meta = build_attention_metadata(decodes, prefills, BLOCK, None, CPU, cascade=True,
                                        kernel=kernel)
    plan = cas_meta.cascade
    assert plan is not None and not plan.nodes and not plan.fresh and len(plan.whole) == 2

    def no_merge(*args: object) -> torch.Tensor:
        raise AssertionError("merged partials of rows that have one each")

    monkeypatch.setattr(cascade_attention, "_merge", no_merge)
    ref_caches, cas_caches = caches.clone(), caches.clone()
    ref = paged_attention(q, k, v, ref_caches[0], ref_caches[1], ref_meta, 0.25)
    out = paged_attention(q, k, v, cas_caches[0], cas_caches[1], cas_meta, 0.25)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
