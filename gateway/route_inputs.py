"""What the router is told about a job (its prefix chain, each candidate's load and
cached prefix) and, once the job ends, whether the prefix credit it was routed on held.

The router (gateway/router.py) only scores Candidates; this module builds them from the
instance pool's view and the router's prefix index.
"""

from __future__ import annotations

from engine.protocol import StreamChunk
from gateway.config import GatewayConfig
from gateway.instances import Instance, InstancePool
from gateway.job import Job
from gateway.metrics import GatewayMetrics
from gateway.router import Candidate
from prefix_cache.hashing import request_extra_keys


def prefix_chain(pool: InstancePool, config: GatewayConfig,
                 job: Job) -> list[tuple[int, int]] | None:
    """The request's sparse chain in the router's prefix index (None: not routing by
    prefix, no engine has reported its block size yet, or the adapter's digest is not
    known yet: no engine has loaded it, so no engine can hold its blocks)."""
    index = pool.index
    if index is None or config.prefix_weight <= 0:
        return None
    lora = None
    if job.adapter is not None:
        digest = pool.digest_of(job.adapter)
        if digest is None:
            return None
        lora = (job.adapter, digest)
    return index.request_chain(job.request.prompt_token_ids,
                               request_extra_keys(lora=lora,
                                                  cache_salt=job.request.cache_salt))


def candidates(pool: InstancePool, config: GatewayConfig, job: Job,
               instances: list[Instance], chain: list[tuple[int, int]] | None,
               key_affine: str | None = None) -> list[Candidate]:
    """The instances as the router scores them; a tenant's tier share scales the per
    instance admission bound (at least 1, so every tier can run somewhere). key_affine:
    the instance the request's prompt_cache_key last went to."""
    matched: dict[str, int] = {}
    if chain is not None and pool.index is not None:
        matched = pool.index.match(chain, [i.instance_id for i in instances])
    bound = max(1, int(config.max_in_flight_per_instance * job.claim.admission_share))
    return [Candidate(
        instance_id=i.instance_id, in_flight=i.in_flight, max_in_flight=bound,
        max_num_seqs=i.max_num_seqs, kv_usage=i.kv_usage, max_loras=i.max_loras,
        resident=i.slot_claims, busy_adapters=i.unevictable,
        matched_tokens=matched.get(i.instance_id, 0),
        key_affine=i.instance_id == key_affine) for i in instances]


def note_prefix_outcome(pool: InstancePool, metrics: GatewayMetrics, job: Job,
                        last: StreamChunk) -> None:
    """Compare the prefix the router credited the instance with to what the engine read
    from its cache (a stale route: the index believed in blocks it no longer had)."""
    index = pool.index
    if (index is None or job.decision is None or last.error is not None
            or job.request.params.prompt_logprobs is not None):  # computed, not read
        return
    block = index.block_size
    # An engine always leaves the prompt's last token to compute.
    credited = min(job.decision.matched_tokens,
                   (len(job.request.prompt_token_ids) - 1) // block * block)
    found = min(credited, last.cached_tokens)
    metrics.prefix_credited.inc(credited)
    metrics.prefix_found.inc(found)
    metrics.prefix_cached.inc(last.cached_tokens)
    if found < credited:
        metrics.stale_routes.inc()
