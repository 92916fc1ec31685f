"""The no-sharing reference: every branch in a fresh context that prefills the whole document.

This is the seed's baseline (SwarmKV's): what ``kvrt demo`` sets beside kvrt and what the
fan-out benchmark keeps as its ``naive`` arm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvrt.branching.branches import Branch
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import generate, prefill
from kvrt.engine.model import Model


@dataclass
class Baseline:
    """Timings of one baseline run, in milliseconds, in branch order."""

    end_to_end_ms: float
    branch_ms: list[float]  # fresh context + prefill + branch, per branch
    prefill_ms: list[float]
    activation_ms: list[float]  # fresh context + prefill + prompt + first token
    texts: list[str]


def run_baseline(model: Model, doc: list[int], branches: list[Branch], params: ContextParams) -> Baseline:
    """SwarmKV's baseline: each branch in a fresh context that prefills the whole document."""
    t0 = time.perf_counter()
    branch_ms, prefill_ms, activation_ms, texts = [], [], [], []
    for branch in branches:
        t_branch = time.perf_counter()
        with Context(model, params) as ctx:
            t_pre = time.perf_counter()
            prefill(ctx, doc, logits_last=False)
            t_doc = time.perf_counter()
            done = generate(ctx, model.tokenize(branch.prompt, add_special=False), branch.params)
        end = time.perf_counter()
        prefill_ms.append((t_doc - t_pre) * 1e3)
        activation_ms.append((t_doc - t_branch) * 1e3 + done.timings_ms["first_token_ms"])
        branch_ms.append((end - t_branch) * 1e3)
        texts.append(done.text)
    return Baseline((time.perf_counter() - t0) * 1e3, branch_ms, prefill_ms, activation_ms, texts)
