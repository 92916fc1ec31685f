#!/usr/bin/env python3
"""Does the order of importing numpy and loading llama.cpp matter? (GPU-machine probe)

Each variant runs in a fresh interpreter that loads a tiny model on the GPU and decodes;
a crash shows as a negative return code (-11 is SIGSEGV) instead of killing this probe.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

LOAD_LLAMA_CPP = ("import llama_cpp; llm = llama_cpp.Llama(MODEL, n_gpu_layers=-1, verbose=False); "
                  "llm('hi', max_tokens=2)")
LOAD_KVRT = ("from kvrt import Model, Context, generate; m = Model(MODEL); c = Context(m, n_ctx=256); "
             "generate(c, 'hi')")
LOAD_THEN = "import kvrt.bindings as b; b.lib(); import numpy; " + LOAD_KVRT + "; "
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "llama_cpp then numpy": ("import llama_cpp, numpy; " + LOAD_LLAMA_CPP, {}),
    "numpy then llama_cpp": ("import numpy; " + LOAD_LLAMA_CPP, {}),
    "kvrt (numpy imported first)": ("import numpy; " + LOAD_KVRT, {}),
    "kvrt (bindings loaded first)": (LOAD_THEN.rstrip("; "), {}),
    # which library does numpy bring that clashes? (OpenBLAS' thread pool, OpenMP)
    "numpy first, OPENBLAS_NUM_THREADS=1": ("import numpy; " + LOAD_KVRT, {"OPENBLAS_NUM_THREADS": "1"}),
    "numpy first, OMP_NUM_THREADS=1": ("import numpy; " + LOAD_KVRT, {"OMP_NUM_THREADS": "1"}),
    # the other direction: C++ extensions imported after llama.cpp is mapped
    "llama then kiwisolver": (LOAD_THEN + "import kiwisolver", {}),
    "llama then PIL._imaging": (LOAD_THEN + "import PIL._imaging", {}),
    "llama then matplotlib.pyplot": (LOAD_THEN + "import matplotlib; matplotlib.use('Agg'); "
                                     "import matplotlib.pyplot as plt; plt.subplots()", {}),
}


def main() -> int:
    from kvrt.modelfiles.testmodels import write_model

    model = write_model(Path(tempfile.mkdtemp()) / "tiny.gguf", "tiny")
    failures = 0
    for name, (code, env) in VARIANTS.items():
        proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", f"MODEL={str(model)!r}; {code}"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        failures += proc.returncode != 0
        print(f"{name:40s} rc={proc.returncode}")
        if proc.returncode != 0:
            print("   " + "\n   ".join(proc.stderr.strip().splitlines()[-12:]))
    import numpy

    blas = numpy.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    print(f"numpy {numpy.__version__} at {numpy.__file__}, blas: {blas.get('name')} {blas.get('version')}")
    print(f"import-order probe: {failures} of {len(VARIANTS)} variants failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
