"""Does a request whose prefix is cached give a cold engine's output? Plain reuse against ``Request(exact=True)``.

On the demo model, for every prompt length in ``--lengths`` and cached prefix length (a
third, a half, 256, 300 and 9, 5, 3, 2, 1 tokens short of the prompt): a cold engine runs
the prompt; a fresh engine runs the prefix (one token), then the prompt. It prints, per
pair, the tokens reused, whether the first token's top-20 log-probabilities (float64
log-softmax over all logits: any changed logit moves them) and the greedy tokens equal the
cold run's, and the largest log-probability difference; then how many pairs differ.
``--beside`` runs every warm prompt while another request decodes.

    python tools/probe_exact_prefix.py --flash-attn off --threads 2 --exact
"""

# ruff: noqa: I001  (kvrt first: it maps llama.cpp before NumPy is imported)
from __future__ import annotations

import argparse
import json

import kvrt  # noqa: F401

from kvrt.runtime.admission import EngineConfig
from kvrt.runtime.batching import Engine
from kvrt.engine.generation import GenerationParams
from kvrt.engine.model import Model
from kvrt.runtime.requests import Request, RequestResult
from kvrt.modelfiles.demo_model import demo_model_path, license_terms_text

TOP = 20


def run(engine: Engine, prompt: list[int], max_tokens: int, exact: bool = False) -> RequestResult:
    request = Request(prompt, GenerationParams(max_tokens=max_tokens), logprobs=TOP, exact=exact)
    return engine.submit(request).result(timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="450,700,1000", help="prompt lengths, comma-separated")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--flash-attn", choices=("off", "on"), default="off")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-layout", choices=("auto", "split", "unified"), default="auto")
    parser.add_argument("--exact", action="store_true", help="the warm prompt is an exact request")
    parser.add_argument("--beside", action="store_true", help="another request decodes beside the warm prompt")
    args = parser.parse_args()

    model = Model(demo_model_path())
    text = license_terms_text()
    tokens = model.tokenize(text[text.find("Gemma Terms of Use"):])
    config = EngineConfig(n_ctx=8192, n_seq_max=8, n_batch=512, prefill_chunk=256, n_threads=args.threads,
                          flash_attn=args.flash_attn, kv_layout=args.kv_layout)
    other = model.tokenize("Write a long story about a lighthouse.")
    pairs = differing = 0
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = tokens[:length]
        with Engine(model, config) as engine:
            cold = run(engine, prompt, args.tokens).choices[0]
        for cached in sorted({length // 3, length // 2, 256, 300, *(length - k for k in (9, 5, 3, 2, 1))}):
            with Engine(model, config) as engine:
                run(engine, prompt[:cached], 1)
                beside = engine.submit(Request(other, GenerationParams(max_tokens=600, ignore_eos=True))) \
                    if args.beside else None
                if beside is not None:
                    beside.get(timeout=600)  # its first token: it decodes from here on
                warm = run(engine, prompt, args.tokens, exact=args.exact)
                if beside is not None:
                    beside.cancel()
            got = warm.choices[0]
            same_first = got.logprobs[0] == cold.logprobs[0]
            same_tokens = got.tokens == cold.tokens
            mine = dict(got.logprobs[0].top)
            diff = max(abs(mine[t] - v) if t in mine else float("inf") for t, v in cold.logprobs[0].top)
            pairs += 1
            differing += not (same_first and same_tokens)
            print(json.dumps({"prompt": length, "cached": cached, "reused": warm.end.cached_tokens,
                              "first_token_logprobs_equal": same_first, "max_logprob_diff": round(diff, 4),
                              "tokens_equal": same_tokens}), flush=True)
    print(json.dumps({"flash_attn": args.flash_attn, "threads": args.threads, "kv_layout": args.kv_layout,
                      "exact": args.exact, "beside": args.beside, "pairs": pairs, "differing": differing}))


if __name__ == "__main__":
    main()
