"""Run kvrt's main job on the embedded default model (Gemma 3 270M from PyPI)."""

from __future__ import annotations

import argparse

HELP = "run kvrt's main job on the demo model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a GGUF to use instead of the demo model")
    parser.add_argument("--prompt", default="The three primary colors are", help="text to complete")
    parser.add_argument("--max-tokens", type=int, default=32)


def run(args: argparse.Namespace) -> int:
    from kvrt.context import Context
    from kvrt.demo_model import demo_model_path
    from kvrt.generation import GenerationParams, generate
    from kvrt.model import Model

    path = args.model or demo_model_path()
    with Model(path) as model, Context(model, n_ctx=512) as ctx:
        print(f"model: {model.description} ({model.path.name})")
        result = generate(ctx, args.prompt, GenerationParams(max_tokens=args.max_tokens))
    print(f"{args.prompt}{result.text}")
    print(f"[{len(result.tokens)} tokens, stop: {result.finish_reason}, "
          f"prefill {result.timings_ms['prefill_ms']:.0f} ms, decode {result.timings_ms['decode_ms']:.0f} ms]")
    return 0
