"""What an :class:`kvrt.memory.elastic_context.ElasticContext` reports: each move between sizes and each spare."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resize:
    """One move of the sequence between contexts: sizes in cells, bytes of state moved, seconds taken."""

    from_ctx: int
    to_ctx: int
    n_tokens: int
    state_bytes: int
    seconds: float
    on_path: bool = True  # False: done ahead, between requests (grow_ahead)
    capture_s: float = 0.0  # of ``seconds``: copying the state out of the old context
    create_s: float = 0.0  # creating the new context (llama.cpp allocates and clears its KV here)
    restore_s: float = 0.0  # loading the state into the new context
    close_s: float = 0.0  # closing the old context and releasing its charge
    spare: bool = False  # the new context was a prepared spare (create_s is 0: it was created ahead)


@dataclass
class Spare:
    """The record of one spare context: created ahead (``create_s``, off the path), then used or dropped.

    ``nbytes`` is its ledger charge; ``held_s`` how long it was held before it was used or
    dropped (while ``outcome`` is ``"held"``, see :meth:`ElasticContext.spare_held_s`).
    """

    n_ctx: int
    nbytes: int
    create_s: float
    created_at: float  # time.perf_counter() when it was ready
    held_s: float = 0.0
    outcome: str = "held"  # "held", "used" (a growth moved into it) or "dropped"

    def end(self, outcome: str, at: float) -> None:
        self.held_s, self.outcome = at - self.created_at, outcome
