#!/usr/bin/env python3
"""Write a deterministic random-weight llama GGUF (tests: ``tiny``; benchmarks: real shapes).

    python tools/make_test_model.py --preset qwen2.5-7b --out /tmp/models/qwen2.5-7b.gguf
"""

from __future__ import annotations

import argparse
import sys
import time

from kvrt.modelfiles.testmodels import PRESETS, write_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, help="path of the GGUF to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    print(f"writing {args.out}: random weights, {shape.label}, ~{shape.weight_bytes() / 2**30:.2f} GiB", flush=True)
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"\r  tensors {done}/{total}", end="", file=sys.stderr, flush=True)

    write_model(args.out, args.preset, seed=args.seed, progress=progress)
    print(f"\ndone in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
