"""Adapter slots the gateway has claimed but the last poll does not show yet
(gateway/instances.py slot_claims): a burst of requests for new adapters, all routed before
the next poll, must not all see the same free slots."""

from __future__ import annotations

import asyncio

import aiohttp

from engine.protocol import GenerateRequest
from gateway.config import GatewayConfig
from gateway.engine_client import HttpEngineClient
from gateway.instances import Instance, InstancePool
from gateway.job import Claim, Job
from gateway.route_inputs import candidates
from gateway.router import Router
from lora.adapter_info import AdapterInfo


def test_a_burst_of_new_adapters_fills_free_slots_then_goes_elsewhere() -> None:
    """Instance a holds two idle adapters (x, y); b has two free slots (max_loras 2 each).
    Four requests for four other adapters, each routed before any poll: two fill b's free
    slots, then b has none left to offer and the other two evict a's idle ones. Before,
    every one of them saw b's free slots and all four queued there."""
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            client = HttpEngineClient("http://127.0.0.1:9", session)  # never called
            a = Instance("a", client, healthy=True, max_loras=2, max_num_seqs=128)
            a.adapters = {name: AdapterInfo(name, f"/adapters/{name}", f"digest-{name}", 8,
                                            True, slot, False, 0)
                          for slot, name in enumerate(("x", "y"))}
            b = Instance("b", client, healthy=True, max_loras=2, max_num_seqs=128)
            by_id = {"a": a, "b": b}
            pool, config, router = InstancePool([], session), GatewayConfig(), Router()
            placed: list[tuple[str, str, str]] = []
            jobs = [Job(GenerateRequest(name, [5, 6, 7], adapter=name), "completions",
                        Claim(None, 1.0)) for name in ("p", "q", "r", "s")]
            for job in jobs:
                decision = router.choose(candidates(pool, config, job, [a, b], None),
                                         job.adapter, 3)
                assert decision is not None
                by_id[decision.instance_id].take(job.adapter)
                placed.append((job.request.request_id, decision.instance_id,
                               decision.reason))
            assert placed == [("p", "b", "adapter_free_slot"), ("q", "b", "adapter_free_slot"),
                              ("r", "a", "adapter_evict"), ("s", "a", "adapter_evict")]
            # Another request for a claimed adapter joins it, as for a resident one.
            again = router.choose(candidates(pool, config, jobs[0], [a, b], None), "p", 3)
            assert again is not None and (again.instance_id, again.reason) == (
                "b", "adapter_resident")
            for job, (_, instance_id, _) in zip(jobs, placed, strict=True):
                by_id[instance_id].release(job.adapter)
            assert (a.in_flight, b.in_flight, a.routed_adapters, b.routed_adapters) == (
                0, 0, {}, {})
            assert a.slot_claims == {"x", "y"} and not b.slot_claims

    asyncio.run(scenario())
