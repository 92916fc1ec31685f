"""The from-scratch reference for agents' histories: a fresh context prefills a whole transcript at once.

Decoding a history turn by turn and prefilling it in one go round differently on the CPU
(a one-token decode and a many-token prefill take different kernels), so two greedy runs
can part at a near tie. :func:`check_greedy` therefore demands the reference's argmax at
every step except where the reference's two best logits are within ``TIE``; the
comparison is teacher-forced, so after a tie it goes on along the agent's own tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.generation import prefill
from kvrt.engine.model import Model
from kvrt.system.gpu import llama_gpu_devices

TIE = 0.5  # logits (the demo model's span ~40): what a different kernel's rounding has been seen to move
KERNEL_NOISE = 1e-2 if llama_gpu_devices() else 1e-4
"""rtol and atol for logits of one computation through other kernels (several rows in one batch, a larger or
unified context): the CPU's agree to float32 rounding; the H200's differed by up to 5e-3 on the tiny model."""


def check_greedy(path: Path, transcript: list[int], probe: str, got: list[int], what: str = "") -> int:
    """Assert ``got`` is the greedy continuation of ``transcript`` + ``probe``; returns the ties passed."""
    ties = 0
    with Model(path, use_extra_bufts=False) as model, Context(model, n_ctx=4096, n_batch=2048, n_ubatch=512,
                                                             n_threads=1, flash_attn="off") as ctx, Batch(1) as one:
        row = prefill(ctx, transcript + model.tokenize(probe, add_special=False))
        for i, token in enumerate(got):
            logits = ctx.logits(row)
            best = int(np.argmax(logits))
            if token != best:
                gap = float(logits[best] - logits[token])
                assert gap <= TIE, f"{what}: step {i} chose {token}, the recompute {best} by {gap:.3f} logits"
                ties += 1
            one.clear()
            row = one.add(token, ctx.seq_len(0), 0, logits=True)
            ctx.decode(one)
    return ties
