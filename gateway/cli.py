"""The `loragate` command line: serve, engine, make-demo, train-adapter, generate (offline),
chat.

Every engine and gateway knob is a flag (see `loragate serve --help`), an environment
variable LORAGATE_<NAME> or a key of the --config file (TOML or YAML); flags win over the
environment, which wins over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.cli_common import DEMO_HOME, local_path
from gateway.cli_models import add_model_commands


def is_loopback(host: str) -> bool:
    from engine.http_auth import is_loopback as loopback

    return loopback(host)


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise


def parse_adapters(specs: Sequence[str], adapter_dir: str | None) -> dict[str, str]:
    """--lora NAME=PATH (repeatable) and --adapter-dir DIR (each PEFT directory inside is an
    adapter named after it) -> name -> absolute path. Under DIR, a link that leads outside
    it (the directory or one of its PEFT files) is skipped with a warning: whoever can write
    into DIR must not make the server read files elsewhere."""
    adapters: dict[str, str] = {}
    if adapter_dir:
        root = Path(adapter_dir)
        if not root.is_dir():
            raise ValueError(f"--adapter-dir {adapter_dir!r} is not a directory")
        real_root = root.resolve()
        for child in sorted(root.iterdir()):
            # Hidden directories are partial (an adapter still being written or unpacked).
            if child.name.startswith(".") or not (child / "adapter_config.json").is_file():
                continue
            real = child.resolve()
            files = (real, real / "adapter_config.json", real / "adapter_model.safetensors")
            if not all(f.resolve().is_relative_to(real_root) for f in files):
                logging.getLogger(__name__).warning(
                    "--adapter-dir: skipping %s: it links outside %s", child, real_root)
                continue
            adapters[child.name] = str(real)
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora expects NAME=PATH, got {spec!r}")
        adapters[name] = str(Path(path).resolve())
    return adapters


def _configs(args: argparse.Namespace, model: str | None) -> tuple[Any, Any]:
    from engine.config import EngineConfig
    from gateway.config import GatewayConfig
    from gateway.config_args import build_config, load_config_file

    file_values = load_config_file(args.config)
    known = ({f for f in EngineConfig.__dataclass_fields__} |
             {f for f in GatewayConfig.__dataclass_fields__} |
             {"instances", "engine", "lora", "adapter_dir", "instance_id"})
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in {args.config}: {', '.join(unknown)}")
    gateway = (build_config(GatewayConfig, args, file_values)
               if hasattr(args, "routing") else None)
    # Served engines schedule by priority unless told otherwise: tenant tiers become request
    # priorities, and with equal priorities the order is the same as fcfs.
    engine_values = {"scheduling_policy": "priority", **file_values}
    engine = build_config(EngineConfig, args, engine_values, model=model) if model else None
    return gateway, engine


def _serve(args: argparse.Namespace) -> int:
    from engine.adapter_roots import roots_from_env
    from engine.default_model import ensure_default_model
    from gateway.demo_adapters import start_training
    from gateway.serve import serve

    _setup_logging()
    model = args.model
    trainer = None
    if model is None and not args.engine:
        model = str(ensure_default_model(DEMO_HOME))
        # Its demo style adapters are trained in the background on first start.
        trainer = start_training(Path(model), DEMO_HOME / "logs" / "demo-adapters.log")
    if model is None:
        raise ValueError("--engine needs --model too: the gateway tokenizes with the model's "
                         "tokenizer (a local copy of the model directory is enough)")
    adapters = parse_adapters(args.lora, args.adapter_dir)
    adapter_dir = args.adapter_dir
    demo_adapters = Path(model) / "adapters"
    if not adapters and adapter_dir is None and demo_adapters.is_dir():
        adapter_dir = str(demo_adapters)
        adapters = parse_adapters([], adapter_dir)
    gateway_config, engine_config = _configs(args, model)
    if gateway_config.adapter_upload_dir:  # recorded in adapter paths the engines load
        gateway_config = dataclasses.replace(
            gateway_config, adapter_upload_dir=local_path(gateway_config.adapter_upload_dir))
    if args.engine_token_file:
        gateway_config = dataclasses.replace(gateway_config, engine_token=_engine_token(args))
    # What local engines may load through their API: the roots given, the adapter directory
    # and the admin API's upload directory (as gateway/admin_api.py build_admin_router sets it).
    roots = [*(args.adapter_root or roots_from_env()), *filter(None, [adapter_dir]),
             gateway_config.adapter_upload_dir or str(Path(model) / "uploaded-adapters")]
    if args.instances < 0 or (args.instances == 0 and not args.engine
                              and not gateway_config.redis_url):
        raise ValueError("--instances 0 needs --engine URL or --redis-url (engine registry)")
    if not (is_loopback(gateway_config.host) or gateway_config.admin_key
            or gateway_config.allow_unauthenticated):
        raise ValueError(f"refusing to serve without authentication on {gateway_config.host}: "
                         f"set --admin-key (and create tenants), or pass "
                         f"--allow-unauthenticated")
    try:
        serve(gateway_config, engine_config, args.instances, args.engine, model, adapters,
              roots, watch_adapter_dir=adapter_dir if trainer is not None else None)
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.terminate()  # the next start trains what is still missing
    return 0


def _engine_token(args: argparse.Namespace) -> str | None:
    """--engine-token or --engine-token-file (not both), else LORAGATE_ENGINE_TOKEN, else
    the config file's engine_token."""
    from engine.http_auth import TOKEN_ENV, check_token, read_token_file
    from gateway.config_args import load_config_file

    given = getattr(args, "engine_token", None)
    if given is not None and args.engine_token_file:
        raise ValueError("give either --engine-token or --engine-token-file, not both")
    if args.engine_token_file:
        return read_token_file(args.engine_token_file)
    if given is None:
        given = os.environ.get(TOKEN_ENV, load_config_file(args.config).get("engine_token"))
    return check_token(None if given is None else str(given))


def _engine(args: argparse.Namespace) -> int:
    from engine.adapter_roots import roots_from_env
    from engine.http_auth import check_exposure

    token = _engine_token(args)
    check_exposure(args.host, token)  # before the heavy imports: fail fast
    if args.register_redis_url and token is None:
        raise ValueError("--register-redis-url needs an engine token (--engine-token-file, "
                         "--engine-token or LORAGATE_ENGINE_TOKEN): gateways only route to "
                         "registrations signed with it")
    from engine.server import serve

    _setup_logging()
    _, engine_config = _configs(args, args.model)
    # Flags win over the environment; --adapter-dir is a root as its adapters are trusted.
    roots = [*(args.adapter_root or roots_from_env()), *filter(None, [args.adapter_dir])]
    background = []
    if args.register_redis_url:
        from gateway.registry import heartbeat

        assert token is not None
        url = args.advertise_url or f"http://{args.host}:{args.port}"
        redis_url = args.register_redis_url
        background.append(lambda: heartbeat(redis_url, url, token))
    serve(engine_config, args.host, args.port, args.instance_id,
          adapters=parse_adapters(args.lora, args.adapter_dir), background=background,
          token=token, adapter_roots=roots)
    return 0


def _add_adapter_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                        help="register a PEFT adapter directory under NAME (repeatable)")
    parser.add_argument("--adapter-dir", default=None, metavar="DIR",
                        help="register every PEFT directory inside DIR, named after it")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="TOML or YAML file of settings (keys are the flag names)")


def _add_engine_access_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-token-file", default=None, metavar="FILE",
                        help="read the engine token from FILE (surrounding whitespace "
                             "stripped) instead of --engine-token")
    parser.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                        help="directory that adapters registered through an engine's API "
                             "(POST /adapters) must lie in (repeatable; env "
                             "LORAGATE_ADAPTER_ROOTS, os.pathsep-separated); --adapter-dir, "
                             "--lora and (serve) the upload directory count too")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loragate", description="Serve one base LLM with many LoRA adapters.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_model_commands(sub)

    from engine.config import EngineConfig
    from gateway.config import GatewayConfig
    from gateway.config_args import add_config_args

    serve = sub.add_parser(
        "serve", help="start engine instances and the OpenAI-compatible gateway",
        description="Start --instances local engine processes (or attach to --engine URLs) "
                    "and the gateway in front of them. Without --model, the default model "
                    "SmolLM2-135M-Instruct is fetched and converted once into "
                    "$LORAGATE_HOME/models (~/.cache/loragate/models). Adapters in the "
                    "model directory's adapters/ folder are registered unless --lora or "
                    "--adapter-dir is given.")
    serve.add_argument("--model", type=local_path, default=None,
                       help="local Hugging Face model directory (default: SmolLM2-135M-"
                            "Instruct, see `loragate fetch-default-model`)")
    serve.add_argument("--instances", type=int, default=1,
                       help="local engine processes to start (default 1; 0 with --redis-url: "
                            "serve the engines registered there by `loragate engine "
                            "--register-redis-url`)")
    serve.add_argument("--engine", action="append", default=[], metavar="URL",
                       help="attach to a running `loragate engine` instead (repeatable)")
    _add_adapter_args(serve)
    _add_engine_access_args(serve)
    add_config_args(serve, GatewayConfig, title="gateway")
    add_config_args(serve, EngineConfig, skip=("model",), title="engine (every instance)")
    serve.set_defaults(func=_serve)

    engine = sub.add_parser("engine", help="one engine instance behind its HTTP API")
    engine.add_argument("--model", type=local_path, required=True,
                        help="local Hugging Face model directory")
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=8100)
    engine.add_argument("--instance-id", default=None,
                        help="name in metrics and routing logs (default HOST:PORT)")
    engine.add_argument("--register-redis-url", default=None, metavar="URL",
                        help="announce this engine in the gateways' Redis (a heartbeat with "
                             "a TTL), so `loragate serve --redis-url URL` finds it")
    engine.add_argument("--advertise-url", default=None, metavar="URL",
                        help="the URL gateways reach this engine at (default http://HOST:PORT)")
    engine.add_argument("--engine-token", default=None, metavar="TOKEN",
                        help="shared secret every caller but GET /health must send as "
                             "'Authorization: Bearer TOKEN' (required beyond loopback; env "
                             "LORAGATE_ENGINE_TOKEN; visible in `ps`: prefer the env or a file)")
    _add_engine_access_args(engine)
    _add_adapter_args(engine)
    add_config_args(engine, EngineConfig, skip=("model",), title="engine")
    engine.set_defaults(func=_engine)
    return parser
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError) as exc:
        print(f"loragate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
