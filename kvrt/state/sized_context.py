"""One sequence's llama.cpp context, charged to the ledger before it exists, and the sizes it may have.

What an agent's context (:mod:`kvrt.state.agent_context`, held by the scheduler's agents and
by elastic contexts) is built from:

* :class:`ChargedContext`: a context and the ledger charge taken for it *before* it was
  created (a refusal creates nothing; a failed creation gives the charge back), closed
  and released together;
* :func:`bucket`: the sizes a growing context moves through, ``min_ctx * 2**k`` capped at
  ``max_ctx`` (so a growth at least doubles, and the headroom stays under twice what is
  needed); a fixed context is the case ``min_ctx == max_ctx``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvrt.accounting.ledger import Reservation, VramLedger
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.model import Model

CTX_PAD = 256  # llama.cpp rounds n_ctx up to a multiple of this, so sizes are multiples of it


def padded(n_cells: int) -> int:
    """``n_cells`` rounded up to a multiple of :data:`CTX_PAD`."""
    return -(-n_cells // CTX_PAD) * CTX_PAD


def bucket(n_tokens: int, min_ctx: int, max_ctx: int) -> int:
    """The smallest ``min_ctx * 2**k`` holding ``n_tokens`` cells, capped at ``max_ctx``."""
    size = min_ctx
    while size < n_tokens:
        size *= 2
    return min(size, max_ctx)


@dataclass
class ChargedContext:
    """A created context and the charge taken for it before it was created (``None``: no ledger)."""

    ctx: Context
    charge: Reservation | None
    create_s: float  # seconds llama.cpp took to create it (allocating and clearing its KV); 0.0: created elsewhere

    @classmethod
    def open(cls, model: Model, params: ContextParams, ledger: VramLedger | None, nbytes: int,
             owner: str) -> ChargedContext:
        """Charge ``nbytes`` to ``owner``, then create the context; raises
        :class:`~kvrt.accounting.ledger.LedgerDenied` creating nothing, and on a failed creation keeps nothing."""
        charge = ledger.try_reserve(nbytes, owner) if ledger is not None else None
        try:
            t0 = time.perf_counter()
            ctx = Context(model, params)
            return cls(ctx, charge, time.perf_counter() - t0)
        except BaseException:
            if charge is not None and ledger is not None:
                ledger.release(charge)
            raise

    def close(self, ledger: VramLedger | None) -> None:
        """Close the context, then give its charge back."""
        self.ctx.close()
        if self.charge is not None and ledger is not None:
            ledger.release(self.charge)
