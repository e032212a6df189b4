"""Random step batches for the cascade attention tests: decodes and prefill chunks whose
block tables share prefixes, as prefix-cache hits make them."""

from __future__ import annotations

import random

import torch

Decodes = list[tuple[list[int], int]]
Prefills = list[tuple[list[int], int, int]]


def random_batch(rng: random.Random, num_blocks: int, block: int, shared_pool: int,
                 length_scale: int = 1) -> tuple[Decodes, Prefills]:
    """Decodes then prefills; tables draw their leading blocks from a few shared prefixes
    (as prefix-cache hits do) and the rest from private blocks, scattered or consecutive
    (read in place, partial last block included). length_scale stretches contexts and
    chunks (1: up to 30 positions of context, chunks of 2-9 rows)."""
    free = list(range(shared_pool, num_blocks))[::-1]
    if rng.random() < 0.5:
        rng.shuffle(free)
    prefixes = [list(range(i * 6, i * 6 + rng.randint(1, 6))) for i in range(shared_pool // 6)]

    def table(num_positions: int) -> tuple[list[int], int]:
        need = -(-num_positions // block)
        shared = rng.choice(prefixes)[: rng.randint(0, need)] if rng.random() < 0.8 else []
        # A shared prefix is only full blocks that precede the request's own positions.
        shared = shared[: max(0, (num_positions - 1) // block)]
        return shared + [free.pop() for _ in range(need - len(shared))], len(shared) * block

    decodes = []
    for _ in range(rng.randint(0, 6)):
        bt, _ = table(rng.randint(1, 30 * length_scale))
        decodes.append((bt, rng.randint(max(1, (len(bt) - 1) * block + 1), len(bt) * block)))
    prefills = []
    for _ in range(rng.randint(0 if decodes else 1, 3)):
        q_len = rng.randint(2, 9 * length_scale)
        start = rng.choice([0, rng.randint(1, 20 * length_scale),
                            block * rng.randint(1, 5 * length_scale)])
        bt, _ = table(start + q_len)
        prefills.append((bt, start, q_len))
    return decodes, prefills


def random_step_tensors(decodes: Decodes, prefills: Prefills, num_heads: int,
                        num_kv_heads: int, head_dim: int, block: int, num_blocks: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's q, k, v (one row per decode and per chunk token) and both caches stacked
    [2, num_blocks, block, Hkv, D], random (torch's global generator)."""
    total = len(decodes) + sum(n for _, _, n in prefills)
    q = torch.randn(total, num_heads, head_dim)
    k = torch.randn(total, num_kv_heads, head_dim)
    v = torch.randn(total, num_kv_heads, head_dim)
    return q, k, v, torch.randn(2, num_blocks, block, num_kv_heads, head_dim)
