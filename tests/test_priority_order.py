"""A request body's priority in loragate's order (larger first) or vLLM's (smaller first),
always inside its tenant's tier."""

from __future__ import annotations

import pytest

from gateway.auth import Principal
from gateway.config import GatewayConfig
from gateway.service import Gateway
from gateway.tenancy import Tenant


def _gateway(order: str) -> Gateway:
    # priority() reads nothing but the config: no pool, router or store is needed.
    gateway = object.__new__(Gateway)
    gateway.config = GatewayConfig(priority_order=order)  # type: ignore[arg-type]
    return gateway


@pytest.mark.parametrize("order, first", [("larger_first", 5), ("smaller_first", -5)])
def test_the_body_priority_order(order: str, first: int) -> None:
    gateway = _gateway(order)
    open_mode = Principal(None)
    ranked = sorted([-5, 0, 5], key=lambda p: -gateway.priority(open_mode, p))
    assert ranked[0] == first
    # A tier always outranks any body priority of a lower tier, in either order.
    gold, free = Principal(Tenant("gold", priority=2)), Principal(Tenant("free", priority=1))
    assert gateway.priority(gold, 999) > gateway.priority(free, -999)
    assert gateway.priority(gold, -999) > gateway.priority(free, 999)


def test_an_unknown_order_is_refused() -> None:
    with pytest.raises(ValueError, match="priority_order"):
        GatewayConfig(priority_order="lowest")  # type: ignore[arg-type]
