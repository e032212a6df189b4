"""AdapterInfo: what an engine reports about one adapter, the record gateways read.

A module of its own, with no tensors in reach: the gateway imports it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterInfo:
    """What list_adapters() reports for one adapter."""

    name: str
    path: str
    digest: str
    rank: int
    in_cpu: bool
    slot: int | None
    pinned: bool
    running_requests: int
