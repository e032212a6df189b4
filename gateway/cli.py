"""The `loragate` command line: serve, engine, make-demo, train-adapter, generate (offline),
chat. `loragate engine` is handed to the engine's own entry point (engine/http/cli.py).

Every engine and gateway knob is a flag (see `loragate serve --help`), an environment
variable LORAGATE_<NAME> or a key of the --config file (TOML or YAML); flags win over the
environment, which wins over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.adapter_roots import check_served_adapters, parse_adapters
from engine.config_args import local_path
from engine.http import cli as engine_cli
from engine.openmp_env import apply_spin_default
from gateway.cli_common import DEMO_HOME
from gateway.cli_models import add_model_commands


def is_loopback(host: str) -> bool:
    from engine.http.auth import is_loopback as loopback

    return loopback(host)


def served_adapters(specs: Sequence[str], adapter_dir: str | None, model: str,
                    attached: bool) -> tuple[dict[str, str], str | None]:
    """(name -> path, the adapter directory) that `serve` registers: those named by --lora /
    --adapter-dir, else the model directory's own `adapters/`, unless the engines are not
    the gateway's own (--engine, or --instances 0 with engines from the Redis registry):
    those load only from their own adapter roots, so the model's adapters are served there
    only when named (and the engines allow them)."""
    adapters = parse_adapters(specs, adapter_dir, local=not attached)
    own = Path(model) / "adapters"
    if not adapters and adapter_dir is None and not attached and own.is_dir():
        adapter_dir = str(own)
        adapters = parse_adapters([], adapter_dir)
    return adapters, adapter_dir


def _configs(args: argparse.Namespace, model: str) -> tuple[Any, Any]:
    from engine.config import EngineConfig
    from engine.config_args import build_config, load_config_file
    from gateway.config import GatewayConfig

    file_values = load_config_file(args.config)
    known = ({f for f in EngineConfig.__dataclass_fields__} |
             {f for f in GatewayConfig.__dataclass_fields__} |
             {"instances", "engine", "lora", "adapter_dir", "instance_id"})
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in {args.config}: {', '.join(unknown)}")
    return (build_config(GatewayConfig, args, file_values),
            engine_cli.engine_config(args, file_values, model))


def _serve(args: argparse.Namespace) -> int:
    from engine.adapter_roots import roots_from_env
    from engine.config import EngineConfig
    from engine.env_names import warn_unknown
    from gateway.config import GatewayConfig
    from gateway.demo_adapters import start_training
    from gateway.serve import serve

    engine_cli.setup_logging()
    warn_unknown("loragate serve", GatewayConfig, EngineConfig)
    model = args.model
    trainers: list[subprocess.Popen[bytes]] = []
    # Engines not started here (--engine, or --instances 0: the Redis registry's).
    attached = bool(args.engine) or args.instances == 0
    if model is None and not args.engine:
        from engine.default_model import ensure_default_model  # converting needs torch

        model = str(ensure_default_model(DEMO_HOME))
        # Its demo adapters are trained here for this gateway's own engines only.
        demo = not attached
    else:
        demo = False

    def train() -> bool:
        """Its demo style adapters are trained in the background on first start (once the
        configuration, the port and the state store passed their checks)."""
        trainer = start_training(Path(model), DEMO_HOME / "logs" / "demo-adapters.log")
        if trainer is None:
            return False
        trainers.append(trainer)
        # Reaped as soon as it exits: no zombie beside a gateway that runs for weeks.
        threading.Thread(target=trainer.wait, name="loragate-trainer-reaper",
                         daemon=True).start()
        return True

    if model is None:
        raise ValueError("--engine needs --model too: the gateway tokenizes with the model's "
                         "tokenizer (a local copy of the model directory is enough)")
    if demo:  # trained into once serve's checks pass: watched and loadable from the start
        (Path(model) / "adapters").mkdir(exist_ok=True)
    found, adapter_dir = served_adapters(args.lora, args.adapter_dir, model,
                                         attached=attached)
    gateway_config, engine_config = _configs(args, model)
    adapters = check_served_adapters(
        args.lora, found, model, engine_config.max_lora_rank,
        gateway_config.served_model_name or model.rstrip("/").split("/")[-1],
        load=not attached)
    if gateway_config.adapter_upload_dir:  # recorded in adapter paths the engines load
        gateway_config = dataclasses.replace(
            gateway_config, adapter_upload_dir=local_path(gateway_config.adapter_upload_dir))
    if args.engine_token_file:
        gateway_config = dataclasses.replace(gateway_config,
                                             engine_token=engine_cli.engine_token(args))
    # What local engines may load through their API: the roots given, the adapter directory
    # and the admin API's upload directory.
    roots = [*(args.adapter_root or roots_from_env()), *filter(None, [adapter_dir]),
             str(gateway_config.upload_dir(model)),
             *gateway_config.adapter_resolver_roots]
    if args.instances < 0:
        raise ValueError(f"--instances must be 0 or more, not {args.instances}")
    if args.instances == 0 and not args.engine and not gateway_config.redis_url:
        raise ValueError("--instances 0 needs --engine URL or --redis-url (engine registry)")
    if not (is_loopback(gateway_config.host) or gateway_config.admin_key
            or gateway_config.allow_unauthenticated):
        raise ValueError(f"refusing to serve without authentication on {gateway_config.host}: "
                         f"set --admin-key (and create tenants), or pass "
                         f"--allow-unauthenticated")
    try:
        serve(gateway_config, engine_config, args.instances, args.engine, model, adapters,
              roots, watch_adapter_dir=adapter_dir if demo else None,
              engine_process=args.engine_process, start_training=train if demo else None,
              withheld=found.keys() - adapters.keys())
    finally:
        for trainer in trainers:
            if trainer.poll() is None:
                trainer.terminate()  # the next start trains what is still missing
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loragate", description="Serve one base LLM with many LoRA adapters.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_model_commands(sub)

    from engine.config import EngineConfig
    from engine.config_args import add_config_args
    from gateway.config import GatewayConfig

    serve = sub.add_parser(
        "serve", help="start engine instances and the OpenAI-compatible gateway",
        description="Start --instances local engines (one: in this process; more: one "
                    "process each) or attach to --engine URLs, and the gateway in front of "
                    "them. Without --model, the default model "
                    "SmolLM2-135M-Instruct is fetched and converted once into "
                    "$LORAGATE_HOME/models (~/.cache/loragate/models). Adapters in the "
                    "model directory's adapters/ folder are registered unless --lora or "
                    "--adapter-dir is given.")
    serve.add_argument("--model", type=local_path, default=None,
                       help="local Hugging Face model directory (default: SmolLM2-135M-"
                            "Instruct, see `loragate fetch-default-model`)")
    serve.add_argument("--instances", type=int, default=1,
                       help="local engine instances (default 1: in the gateway's process; "
                            "more: one process each; 0 with --redis-url: serve the engines "
                            "registered there by `loragate engine --register-redis-url`)")
    serve.add_argument("--engine-process", action="store_true",
                       help="run a single local instance in its own process too (HTTP "
                            "between gateway and engine, restarted by a supervisor when it "
                            "exits) instead of in the gateway's process")
    serve.add_argument("--engine", action="append", default=[], metavar="URL",
                       help="attach to a running `loragate engine` instead (repeatable)")
    engine_cli.add_adapter_args(serve)
    engine_cli.add_engine_access_args(serve)
    add_config_args(serve, GatewayConfig, title="gateway")
    add_config_args(serve, EngineConfig, skip=("model",), title="engine (every instance)",
                    defaults=engine_cli.SERVED_DEFAULTS)
    serve.set_defaults(func=_serve)

    engine_cli.add_arguments(sub.add_parser("engine", help=engine_cli.HELP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    apply_spin_default()  # before torch is imported (engine/openmp_env.py)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["engine"]:  # the engine's own entry point: no gateway code runs
        return engine_cli.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError) as exc:
        print(f"loragate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
