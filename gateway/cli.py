"""The `loragate` command line: make-demo, generate (offline), chat (interactive)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _make_demo(args: argparse.Namespace) -> int:
    from engine.demo_model import DemoModelSpec, make_demo_adapters, make_demo_model

    spec = DemoModelSpec(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings, seed=args.seed,
    )
    out = make_demo_model(args.dir, spec)
    print(f"demo model written to {out}")
    for path in make_demo_adapters(out, args.adapters, seed=args.seed):
        print(f"demo adapter written to {path}")
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


def build_parser() -> argparse.ArgumentParser:
    from engine.demo_model import DemoModelSpec

    parser = argparse.ArgumentParser(
        prog="loragate", description="Serve one base LLM with many LoRA adapters.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("make-demo", help="write a seeded random-weight Llama model with a "
                          "trained BPE tokenizer (HF format) into DIR")
    demo.add_argument("dir")
    defaults = DemoModelSpec()
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "max_position_embeddings", "seed"):
        demo.add_argument(f"--{name.replace('_', '-')}", type=int,
                          default=getattr(defaults, name),
                          help=f"(default {getattr(defaults, name)})")
    demo.add_argument("--adapters", type=int, default=4,
                      help="seeded random PEFT LoRA adapters to write under DIR/adapters "
                           "(ranks 8 and 16; default 4)")
    demo.set_defaults(func=_make_demo)

    gen = sub.add_parser("generate", help="offline generation for a few prompts")
    gen.add_argument("--model", required=True, help="local Hugging Face model directory")
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="auto")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="interactive prompt, answers streamed by the engine")
    chat.add_argument("--model", required=True, help="local Hugging Face model directory")
    chat.add_argument("--max-tokens", type=int, default=64)
    chat.add_argument("--temperature", type=float, default=0.8)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--device", default="auto")
    chat.set_defaults(func=_chat)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"loragate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
