"""The engine's HTTP API: the server over an AsyncEngine, its bodies, errors, metrics,
token auth, drain, the signed registry heartbeat and the `loragate engine` entry point."""
