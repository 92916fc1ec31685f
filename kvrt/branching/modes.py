"""Which mode a fan-out runs in, and the context parameters each mode needs.

``mode="auto"`` picks shared whenever there are several branches and their cells fit one
context (see :mod:`kvrt.branching.branches`), isolated otherwise; a mode that was asked
for and cannot run is refused with the limit that stops it. Contexts are sized in
multiples of ``CELL_ALIGN`` cells.
"""

from __future__ import annotations

from typing import Literal, get_args

from kvrt.branching.branch import FanoutError
from kvrt.engine.context_params import ContextParams
from kvrt.state.contextpool import ContextPool

Mode = Literal["auto", "isolated", "shared"]
MODES: tuple[str, ...] = get_args(Mode)
Fork = Literal["during_prefill", "after_prefill"]
FORKS: tuple[str, ...] = get_args(Fork)
CELL_ALIGN = 256
LLAMA_MAX_SEQ = 256  # llama.cpp's limit on the sequences of one context


def _align(n: int) -> int:
    return -(-n // CELL_ALIGN) * CELL_ALIGN


def isolated_params(cells: int, *, n_batch: int = 512, n_threads: int | None = None,
                    flash_attn: str = "off") -> ContextParams:
    """Parameters of an isolated-mode context: one sequence of ``cells`` (document + longest branch)."""
    return ContextParams(n_ctx=_align(cells), n_batch=n_batch, n_ubatch=min(n_batch, 512), n_threads=n_threads,
                         flash_attn=flash_attn)


def shared_params(cells: int, n_seq: int, *, n_batch: int = 512, n_threads: int | None = None,
                  flash_attn: str = "off") -> ContextParams:
    """Parameters of a shared-mode context: unified KV, ``n_seq`` sequences, ``cells`` cells in all.

    ``cells`` must cover the document plus every branch's prompt and ``max_tokens``
    (the branches' cells are not shared, only the document's).
    """
    return ContextParams(n_ctx=_align(cells), n_batch=n_batch, n_ubatch=min(n_batch, 512), n_seq_max=n_seq,
                         kv_unified=True, n_threads=n_threads, flash_attn=flash_attn)


def _shared_misfit(pool: ContextPool, n: int, cells: int) -> str | None:
    """Why ``pool``'s contexts cannot hold ``n`` branches sharing ``cells`` cells, or None."""
    p = pool.params
    if not p.kv_unified:
        return "its contexts are not kv_unified (each sequence would have its own cells, nothing shared)"
    if p.n_seq_max < n:
        return f"its contexts hold {p.n_seq_max} sequences, {n} branches need {n}"
    if p.n_ctx < cells:
        return f"its contexts have {p.n_ctx} cells, document + every branch needs {cells}"
    return None


def _shared_misfit_limits(n: int, cells: int, limit: int, limit_name: str) -> str | None:
    """Which hard limit keeps ``n`` branches sharing ``cells`` cells out of one context, or None."""
    reasons = []
    if n > LLAMA_MAX_SEQ:
        reasons.append(f"{n} branches need {n} sequences; llama.cpp allows at most {LLAMA_MAX_SEQ} in one context "
                       "(LLAMA_MAX_SEQ)")
    if cells > limit:
        reasons.append(f"{n} branches need {cells} cells in one context; {limit_name} allows {limit}")
    return "; ".join(reasons) or None


def choose_mode(mode: Mode, n: int, shared_cells: int, limit: int, limit_name: str,
                 pool: ContextPool | None) -> tuple[str, str]:
    if mode == "isolated":
        return mode, "requested"
    too_big = _shared_misfit_limits(n, shared_cells, limit, limit_name)
    misfit = _shared_misfit(pool, n, shared_cells) if pool is not None else None
    if mode == "shared":
        if too_big is not None:
            raise FanoutError(f"shared mode cannot run: {too_big}")
        if misfit is not None:
            raise FanoutError(f"shared mode cannot use the context pool: {misfit} (build its parameters with "
                              f"kvrt.branching.branches.shared_params({shared_cells}, {n}))")
        return mode, "requested"
    if n == 1:
        return "isolated", "auto: one branch has nothing to share a context with"
    if too_big is not None:
        return "isolated", f"auto: {too_big}"
    if misfit is not None:
        return "isolated", f"auto: the context pool cannot share: {misfit}"
    return "shared", f"auto: {n} branches fit one context ({shared_cells} cells <= {limit})"
