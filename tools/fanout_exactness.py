"""How many fan-out branches diverge from a from-scratch llama-cpp-python evaluation, and what each mode costs.

On the demo model: a document of ``--doc-tokens`` tokens of the Gemma terms, ``--branches``
questions, ``--tokens`` greedy tokens each. The reference is a ``llama_cpp.Llama`` (this
machine's extra-buffer verdict) reset between branches: document, then question, then each
token. For every mode it prints the branches that differ (first differing token and the
reference's top-two logit margin there), the fan-out's wall time and the time after the
document's prefill and fork (medians of ``--repeats``).

    python tools/fanout_exactness.py --flash-attn off --threads 2
"""

# ruff: noqa: I001  (kvrt first: it maps llama.cpp before NumPy is imported)
from __future__ import annotations

import argparse
import json
import statistics
import time

import kvrt  # noqa: F401

from kvrt.branching.branch import Branch
from kvrt.branching.branches import fanout
from kvrt.engine.generation import GenerationParams
from kvrt.engine.model import Model
from kvrt.modelfiles.demo_model import demo_model_path, license_terms_text
from kvrt.system.cpu import llama_cpp_llama
from kvrt_bench._peer import greedy_reference

QUESTIONS = [
    "\n\nIn one sentence, the document above is about",
    "\n\nQuestion: who is Google in this agreement?\nAnswer:",
    "\n\nThe obligations it places on distributors are:\n1.",
    "\n\nSummary of section 3:",
    "\n\nA title for this text:",
    "\n\nThe most important word in the document is",
]
MODES = {"isolated": ("isolated", False), "isolated-exact": ("isolated", True), "shared": ("shared", False),
         "shared-exact": ("shared", True)}


def first_divergence(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc-tokens", type=int, default=934)
    parser.add_argument("--branches", type=int, default=6, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--flash-attn", choices=("off", "on"), default="off")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    path = demo_model_path()
    model = Model(path)
    text = license_terms_text()
    doc = model.tokenize(text[text.find("Gemma Terms of Use"):])[:args.doc_tokens]
    questions = QUESTIONS[:args.branches]
    branches = [Branch(q, GenerationParams(max_tokens=args.tokens), f"q{i}") for i, q in enumerate(questions)]
    llm = llama_cpp_llama(path, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, flash_attn=args.flash_attn == "on", verbose=False)
    refs = [greedy_reference(llm, [doc], model.tokenize(q, add_special=False), args.tokens) for q in questions]
    llm.close()
    report: dict[str, object] = {"doc_tokens": len(doc), "branches": len(branches), "tokens": args.tokens,
                                 "flash_attn": args.flash_attn, "threads": args.threads}
    for name, (mode, exact) in MODES.items():
        times, results = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            results.append(fanout(model, doc, branches, mode=mode, exact=exact, n_threads=args.threads,
                                  flash_attn=args.flash_attn))
            times.append(time.perf_counter() - t0)
        got = [b.completion.tokens for b in results[-1].branches]
        diverged = {}
        for i, (tokens, ref) in enumerate(zip(got, refs)):
            k = first_divergence(tokens, ref.tokens)
            if k is not None:
                diverged[f"q{i}"] = {"token": k, "margin": round(ref.margins[k], 3)}
        branch_phase = [(r.total_ms - r.prefill_ms - r.fork_ms) / 1e3 for r in results]
        report[name] = {"diverged": diverged, "median_s": round(statistics.median(times), 3),
                        "times_s": [round(t, 3) for t in times],
                        "branch_phase_median_s": round(statistics.median(branch_phase), 3)}
        print(name, json.dumps(report[name]), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
