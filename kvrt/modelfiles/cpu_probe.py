"""The probe child of :mod:`kvrt.system.cpu`: are llama.cpp's CPU extra buffer types safe on this machine?

Run as ``python -m kvrt.modelfiles.cpu_probe`` by :func:`kvrt.system.cpu.run_probe`, in a
process of its own: a CPU that advertises instructions it does not honour kills this
child, never the caller. It writes a small Q4_0 model (:data:`PROBE_PRESET`), decodes a
short prompt greedily through the extra buffer types and through the plain kernels, and
prints one JSON line, ``{"ok": ..., "detail": ...}``: ok when the last logits agree within
10 % of the plain kernels' range. Verdicts are cached under :data:`kvrt.system.cpu.PROBE_VERSION`:
raise it when what this child checks changes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.modelfiles.testmodels import write_model

PROBE_PRESET = "probe-q4_0"
_PROBE_TOKENS = 4
_PROBE_TOLERANCE = 0.1  # extra-buffer logits within 10 % of the plain kernels' logit range


def _greedy_run(path: Path, use_extra_bufts: bool) -> tuple[list[int], list[float]]:
    """Greedy tokens and the last logits of a short prompt on the CPU."""
    with Model(path, n_gpu_layers=0, use_extra_bufts=use_extra_bufts) as model, \
            Context(model, n_ctx=128, n_batch=64, n_ubatch=64, n_threads=2) as ctx, Batch(64) as batch:
        row = prefill(ctx, model.tokenize("extra buffer type probe: " * 2), batch=batch)
        tokens: list[int] = []
        for _ in range(_PROBE_TOKENS):
            logits = ctx.logits(row)
            tokens.append(int(logits.argmax()))
            batch.clear()
            row = batch.add(tokens[-1], ctx.seq_len(0), 0, logits=True)
            ctx.decode(batch)
        return tokens, [float(x) for x in ctx.logits(row)]


def _probe_child() -> dict[str, object]:
    """Decode through the extra buffer types and through the plain kernels; compare."""
    with tempfile.TemporaryDirectory(prefix="kvrt-probe-") as tmp:
        path = write_model(Path(tmp) / "probe.gguf", PROBE_PRESET)
        _, plain = _greedy_run(path, use_extra_bufts=False)
        _, extra = _greedy_run(path, use_extra_bufts=True)
    plain_a, extra_a = np.asarray(plain), np.asarray(extra)
    if not np.isfinite(extra_a).all():
        return {"ok": False, "detail": "the extra buffer types produced non-finite logits"}
    spread = float(plain_a.max() - plain_a.min()) or 1.0
    diff = float(np.abs(extra_a - plain_a).max())
    ok = diff <= _PROBE_TOLERANCE * spread
    return {"ok": ok, "detail": f"max logit difference {diff:.3g} against a range of {spread:.3g}"}


if __name__ == "__main__":
    print(json.dumps(_probe_child()), flush=True)
