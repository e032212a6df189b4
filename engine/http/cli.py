"""`loragate engine`: one engine instance behind its HTTP API (engine/http/server.py).

The engine's own entry point: ``python -m engine.http`` (what `loragate serve` starts for
its engine processes) and the `engine` subcommand of `loragate` take the same flags. Every
EngineConfig field is a flag, an environment variable LORAGATE_<NAME> or a key of the
--config file; keys of the file that are no engine setting are left to the gateway (one file
may serve both).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from engine.config_args import add_config_args, build_config, load_config_file, local_path
from engine.openmp_env import apply_spin_default


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise


SERVED_DEFAULTS: dict[str, Any] = {"scheduling_policy": "priority"}
"""EngineConfig defaults of served engines (`serve`, `engine`) that differ from the
library's: they schedule by priority, since tenant tiers become request priorities (with
equal priorities the order is the same as fcfs)."""


def engine_config(args: argparse.Namespace, file_values: dict[str, Any], model: str) -> Any:
    """The EngineConfig of flags > env > file > SERVED_DEFAULTS > defaults."""
    from engine.config import EngineConfig

    return build_config(EngineConfig, args, {**SERVED_DEFAULTS, **file_values}, model=model)


def engine_token(args: argparse.Namespace) -> str | None:
    """--engine-token or --engine-token-file (not both), else LORAGATE_ENGINE_TOKEN, else
    the config file's engine_token."""
    from engine.http.auth import TOKEN_ENV, check_token, read_token_file

    given = getattr(args, "engine_token", None)
    if given is not None and args.engine_token_file:
        raise ValueError("give either --engine-token or --engine-token-file, not both")
    if args.engine_token_file:
        return read_token_file(args.engine_token_file)
    if given is None:
        given = os.environ.get(TOKEN_ENV, load_config_file(args.config).get("engine_token"))
    return check_token(None if given is None else str(given))


def run(args: argparse.Namespace) -> int:
    from engine.adapter_roots import check_served_adapters, parse_adapters, roots_from_env
    from engine.http.auth import check_exposure
    from engine.http.listen import check_port_free

    token = engine_token(args)
    check_exposure(args.host, token)  # before the heavy imports: fail fast
    if args.register_redis_url and token is None:
        raise ValueError("--register-redis-url needs an engine token (--engine-token-file, "
                         "--engine-token or LORAGATE_ENGINE_TOKEN): gateways only route to "
                         "registrations signed with it")
    check_port_free(args.host, args.port)
    adapters = parse_adapters(args.lora, args.adapter_dir)
    from engine.config import EngineConfig
    from engine.env_names import warn_unknown
    from engine.http.server import serve
    from engine.parent_watch import PARENT_ENV, exit_with_parent

    setup_logging()
    config = engine_config(args, load_config_file(args.config), args.model)
    if PARENT_ENV not in os.environ:  # a child of serve: serve checked what it passed on
        warn_unknown("loragate engine", EngineConfig)
        adapters = check_served_adapters(args.lora, adapters, args.model,
                                         config.max_lora_rank,
                                         args.model.rstrip("/").split("/")[-1], load=True)
    exit_with_parent()
    # Flags win over the environment; --adapter-dir is a root as its adapters are trusted.
    roots = [*(args.adapter_root or roots_from_env()), *filter(None, [args.adapter_dir])]
    background = []
    if args.register_redis_url:
        from engine.http.registry import heartbeat, registry_client

        assert token is not None
        url = args.advertise_url or f"http://{args.host}:{args.port}"
        client = registry_client(args.register_redis_url)
        background.append(lambda engine: heartbeat(client, url, token,
                                                    draining=lambda: engine.draining))
    serve(config, args.host, args.port, args.instance_id,
          adapters=adapters, background=background,
          token=token, adapter_roots=roots, drain_timeout_s=args.drain_timeout_s)
    return 0


def add_adapter_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                        help="register a PEFT adapter directory under NAME (repeatable)")
    parser.add_argument("--adapter-dir", default=None, metavar="DIR",
                        help="register every PEFT directory inside DIR, named after it")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="TOML or YAML file of settings (keys are the flag names)")


def add_engine_access_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-token-file", default=None, metavar="FILE",
                        help="read the engine token from FILE (surrounding whitespace "
                             "stripped) instead of --engine-token")
    parser.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                        help="directory that adapters registered through an engine's API "
                             "(POST /adapters) must lie in (repeatable; env "
                             "LORAGATE_ADAPTER_ROOTS, os.pathsep-separated); --adapter-dir, "
                             "--lora and (serve) the upload directory count too")


DRAIN_ENV = "LORAGATE_DRAIN_TIMEOUT_S"


def drain_seconds(text: str) -> float:
    """A drain timeout: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}"
                                         ) from None
    if not 0 < value < math.inf:  # refuses NaN too
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got "
                                         f"{text!r}")
    return value


REGISTER_ENV = "LORAGATE_REGISTER_REDIS_URL"
ADVERTISE_ENV = "LORAGATE_ADVERTISE_URL"


def add_arguments(engine: argparse.ArgumentParser) -> None:
    """The flags of `loragate engine`."""
    from engine.config import EngineConfig

    engine.add_argument("--model", type=local_path, required=True,
                        help="local Hugging Face model directory")
    engine.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1)")
    engine.add_argument("--port", type=int, default=8100,
                        help="port to listen on (default 8100)")
    engine.add_argument("--drain-timeout-s", type=drain_seconds,
                        default=os.environ.get(DRAIN_ENV, "30"), metavar="SECONDS",
                        help="on SIGTERM, how long requests in flight may take to finish; "
                             "those still running then end with a shutdown error "
                             f"(default 30; env {DRAIN_ENV})")
    engine.add_argument("--instance-id", default=None,
                        help="name in metrics and routing logs (default HOST:PORT)")
    engine.add_argument("--register-redis-url", default=os.environ.get(REGISTER_ENV),
                        metavar="URL",
                        help="announce this engine in the gateways' Redis (a heartbeat with "
                             "a TTL), so `loragate serve --redis-url URL` finds it (env "
                             f"{REGISTER_ENV}: keeps a password out of `ps`)")
    engine.add_argument("--advertise-url", default=os.environ.get(ADVERTISE_ENV),
                        metavar="URL",
                        help="the URL gateways reach this engine at (default http://HOST:PORT;"
                             f" env {ADVERTISE_ENV})")
    engine.add_argument("--engine-token", default=None, metavar="TOKEN",
                        help="shared secret every caller but GET /health must send as "
                             "'Authorization: Bearer TOKEN' (required beyond loopback; env "
                             "LORAGATE_ENGINE_TOKEN; visible in `ps`: prefer the env or a file)")
    add_engine_access_args(engine)
    add_adapter_args(engine)
    add_config_args(engine, EngineConfig, skip=("model",), title="engine",
                    defaults=SERVED_DEFAULTS)
    engine.set_defaults(func=run)


HELP = "one engine instance behind its HTTP API"


def main(argv: Sequence[str] | None = None) -> int:
    apply_spin_default()  # before torch is imported (engine/openmp_env.py)
    parser = argparse.ArgumentParser(prog="loragate engine", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, RuntimeError) as exc:
        print(f"loragate: error: {exc}", file=sys.stderr)
        return 2
