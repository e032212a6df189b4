"""The OpenAI-compatible gateway: tenants, keys and limits, LoRA- and prefix-aware routing
over engine instances, the admin API (gateway.app.create_app builds the ASGI app). The top
of the package chain: it may import every other package, and none imports it
(tests/test_import_graph.py). Only the config is re-exported here: the package's modules run
as programs (`python -m gateway.cli`), so importing the package must not import them."""

from gateway.config import GatewayConfig

__all__ = ["GatewayConfig"]
