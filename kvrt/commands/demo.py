"""``kvrt demo``: the two-agent fan-out over the demo model's license, kvrt beside the baseline (see DESCRIPTION)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvrt.bindings import FLASH_ATTN

if TYPE_CHECKING:
    from kvrt.engine.model import Model

HELP = "two agents (overview, obligations) over the Gemma license: one prefill vs. the baseline's two"
DESCRIPTION = """Two agents read the same document, the Gemma Terms of Use that ship with the demo model:
one writes an overview, the other lists the obligations. kvrt reads the document once and
starts both agents from a snapshot of it; the baseline reads it once per agent. Both answers
and the timings are printed side by side, and the answers are checked to be the same.
Flash attention is off by default because llama.cpp's multi-threaded CPU flash-attention
kernel sums a restored Gemma cache in another order, which can change a greedy token a few
steps in (try --flash-attn auto)."""

OVERVIEW = "\n\nIn one or two sentences, the document above is about"
OBLIGATIONS = "\n\nObligations the document above places on anyone who uses or distributes Gemma:\n1."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a GGUF to use instead of the demo model")
    parser.add_argument("--doc-tokens", type=int, default=1200,
                        help="use the first N tokens of the license (0: all ~3,200; ~10 s of prefill per copy "
                             "on a 2-core CPU at full length, well under a second on a GPU)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens each agent writes at most")
    parser.add_argument("--n-gpu-layers", type=int, default=-1,
                        help="layers on the GPU (-1: all; no-op on a CPU build)")
    parser.add_argument("--flash-attn", choices=tuple(FLASH_ATTN), default="off",
                        help="flash attention in both kvrt's and the baseline's contexts")


def _document(model: Model, limit: int) -> list[int]:
    from kvrt.modelfiles.demo_model import license_terms_text

    text = license_terms_text()
    start = text.find("Gemma Terms of Use")  # skip the site navigation above the terms
    tokens = model.tokenize(text[max(start, 0):])
    return tokens[:limit] if limit > 0 else tokens


def _show_progress(name: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    print(f"\r  prefill {name}: [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens",
          end="\n" if done == total else "", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from kvrt.branching.baseline import run_baseline
    from kvrt.branching.branches import Branch
    from kvrt.branching.pipeline import Pipeline
    from kvrt.engine.context_params import ContextParams
    from kvrt.engine.generation import GenerationParams
    from kvrt.engine.model import Model
    from kvrt.modelfiles.demo_model import demo_model_path

    params = GenerationParams(max_tokens=args.max_tokens, stop=("\n\n",))
    with Model(args.model or demo_model_path(), n_gpu_layers=args.n_gpu_layers) as model:
        doc = _document(model, args.doc_tokens)
        n_ctx = -(-(len(doc) + 64 + args.max_tokens) // 256) * 256
        print(f"model: {model.description} ({model.path.name}); document: Gemma Terms of Use, {len(doc)} tokens",
              file=sys.stderr)

        print("kvrt: prefill once, two branches from the snapshot", file=sys.stderr)
        pipe = Pipeline(model, n_ctx=n_ctx, flash_attn=args.flash_attn)
        pipe.document("license", doc)
        pipe.branch("overview", OVERVIEW, after="license", params=params)
        pipe.branch("obligations", OBLIGATIONS, after="license", params=params)
        result = pipe.run(progress=_show_progress)

        print("baseline: two fresh contexts, each prefilling the whole document", file=sys.stderr)
        branches = [Branch(OVERVIEW, params), Branch(OBLIGATIONS, params)]
        base = run_baseline(model, doc, branches, ContextParams(n_ctx=n_ctx, flash_attn=args.flash_attn))

    print("\n== Agent 1: overview ==")
    print(("The document is about" + result.outputs["overview"].text).strip())
    print("\n== Agent 2: obligations ==")
    print(("1." + result.outputs["obligations"].text).strip())
    kvrt_e2e = result.total_ms
    kvrt_act = result.timings_ms["obligations"]["activation_ms"]
    rows = [
        ("End-to-end ms", base.end_to_end_ms, kvrt_e2e),
        ("Branch-2 activation ms", base.activation_ms[1], kvrt_act),
        ("Document prefill ms", sum(base.prefill_ms), result.timings_ms["license"]["prefill_ms"]),
    ]
    print(f"\n| {'metric':<24} | {'baseline':>10} | {'kvrt':>10} | {'ratio':>7} |")
    print(f"|{'-' * 26}|{'-' * 12}|{'-' * 12}|{'-' * 9}|")
    for label, b, k in rows:
        print(f"| {label:<24} | {b:>10.1f} | {k:>10.1f} | {b / k:>6.2f}x |")
    print(f"\nredundant prefill removed: {base.prefill_ms[1]:.0f} ms; end-to-end "
          f"{100 * (1 - kvrt_e2e / base.end_to_end_ms):.1f}% faster; branch-2 activation "
          f"{100 * (1 - kvrt_act / base.activation_ms[1]):.1f}% lower")
    same = [result.outputs["overview"].text, result.outputs["obligations"].text] == base.texts
    print(f"answers identical to the baseline's: {same}" + ("" if same or args.flash_attn == "off" else
          " (flash attention on: see `kvrt demo --help` and the module docstring of kvrt.commands.demo)"))
    return 0
