"""What placement can do for prefix reuse, computed from a request list alone (no engines).

    python -m benchmarks.routing_replay [--requests 120] [--kv-blocks 2048,512]

Replays the routing benchmark's workload (gateway_bench: the RAG workload over 8 adapters)
against idealized per-instance prefix caches and reports the hit rate each placement gets:
- ``one cache``: every request sees one shared cache holding the instances' blocks together
  (unbounded: the most any placement of these requests over several instances can reach);
- ``round_robin``: requests dealt to the instances in turn;
- ``by adapter``: every adapter's requests on one instance (adapter index mod instances).
Caches are LRU over whole blocks with the given capacity per instance (unbounded with
``none``); a hit is the longest chain of cached full blocks, capped one token short of the
prompt as the engine caps it. Blocks of different adapters never match (the adapter is part
of every block hash), as in the engine. Running requests pinning blocks, chunked prefill
and the engine's pool-aware eviction order are not modelled, so live hit rates differ a
little; the ratios between placements are what this is for.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.rag_workload import RagSpec, make_rag_workload
from benchmarks.serving import assign_adapters, from_workload
from benchmarks.serving_client import ServingRequest
from prefix_cache.hashing import chain_hashes, request_extra_keys

BLOCK_SIZE = 16
PLACEMENTS = ("one cache", "round_robin", "by adapter")


@dataclass(frozen=True)
class ReplayResult:
    placement: str
    kv_blocks: int | None
    hit_rate: float


def routing_workload(num_requests: int, adapters: Sequence[str], vocab_size: int = 8192,
                     turns_per_session: int = 1) -> list[ServingRequest]:
    """gateway_bench's routing workload: 32 documents, Zipf 1.1, adapters drawn uniformly
    (per conversation when ``turns_per_session`` > 1)."""
    spec = RagSpec(num_requests=num_requests, num_documents=32, vocab_size=vocab_size, seed=4,
                   turns_per_session=turns_per_session)
    rag = make_rag_workload(spec)
    sessions = [r.session_id for r in rag] if turns_per_session > 1 else None
    return assign_adapters(from_workload(rag), adapters, seed=5, sessions=sessions)


def replay(requests: Sequence[ServingRequest], adapters: Sequence[str], instances: int,
           placement: str, kv_blocks: int | None) -> float:
    """Prefix hit rate (hit tokens / prompt tokens) of one placement."""
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(instances)]
    if placement == "one cache" and kv_blocks is not None:
        kv_blocks *= instances
    hit_tokens = prompt_tokens = 0
    for i, request in enumerate(requests):
        prompt = list(request.prompt_token_ids)
        extra = request_extra_keys((request.lora, "replay") if request.lora else None)
        hashes = chain_hashes(prompt, BLOCK_SIZE, extra)
        if placement == "one cache":
            cache = caches[0]
        elif placement == "round_robin":
            cache = caches[i % instances]
        elif placement == "by adapter":
            cache = caches[list(adapters).index(request.lora) % instances if request.lora else 0]
        else:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        matchable = (len(prompt) - 1) // BLOCK_SIZE
        matched = 0
        for block_hash in hashes[:matchable]:
            if block_hash not in cache:
                break
            matched += 1
        hit_tokens += matched * BLOCK_SIZE
        prompt_tokens += len(prompt)
        for block_hash in hashes:
            cache[block_hash] = None
            cache.move_to_end(block_hash)
        while kv_blocks is not None and len(cache) > kv_blocks:
            cache.popitem(last=False)
    return hit_tokens / max(1, prompt_tokens)


def replay_all(requests: Sequence[ServingRequest], adapters: Sequence[str], instances: int,
               kv_blocks: Sequence[int | None]) -> list[ReplayResult]:
    return [ReplayResult(placement, blocks, replay(requests, adapters, instances, placement,
                                                   blocks))
            for blocks in kv_blocks for placement in PLACEMENTS]


def main(argv: list[str] | None = None) -> list[ReplayResult]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--turns", type=int, default=1,
                        help="requests per conversation (1 = single-turn RAG)")
    parser.add_argument("--kv-blocks", default="none,2048,512",
                        help="comma-separated blocks per instance; none = unbounded")
    args = parser.parse_args(argv)
    adapters = [f"bench-{i}" for i in range(8)]
    sizes = [None if v == "none" else int(v) for v in args.kv_blocks.split(",")]
    requests = routing_workload(args.requests, adapters, turns_per_session=args.turns)
    results = replay_all(requests, adapters, args.instances, sizes)
    print(f"{'KV blocks':>10} {'placement':>12} {'hit rate':>9} {'vs round_robin':>15}")
    for r in results:
        rr = next(x for x in results if x.kv_blocks == r.kv_blocks
                  and x.placement == "round_robin")
        print(f"{r.kv_blocks or 'none':>10} {r.placement:>12} {r.hit_rate:>9.1%} "
              f"{r.hit_rate / max(1e-9, rr.hit_rate):>14.2f}x")
    return results


if __name__ == "__main__":
    main()
