"""What the HTTP front does with a prompt longer than one request's cells: refuse it, or shift it.

``refuse`` (the default): the 400 ``context_length_exceeded`` naming the limit, as before.
``shift``: llama.cpp's context shift, applied to the prompt before it is submitted: the first ``keep`` tokens
(a system prompt, a BOS) and the most recent ones stay, the middle is dropped, so that the prompt and the output
the request may write fit the request's cells. Nothing is truncated silently: a shifted request's answer says so
in the ``X-Kvrt-Context-Shift`` header (streamed or not) and, unstreamed, in a ``kvrt.context_shift`` field, with
the tokens dropped and the prompt's length before and after; ``usage.prompt_tokens`` counts the shifted prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrt.errors import KvrtError
from kvrt.runtime.admission import EngineConfig
from kvrt.serve.api_error import ApiError

POLICIES = ("refuse", "shift")
HEADER = "X-Kvrt-Context-Shift"


@dataclass(frozen=True)
class ContextShift:
    """One shifted prompt: ``before`` tokens became ``after``, the first ``keep`` kept (invariant: after < before)."""

    before: int
    after: int
    keep: int

    @property
    def dropped(self) -> int:
        return self.before - self.after

    def field(self) -> dict[str, Any]:
        """The ``kvrt.context_shift`` object of an unstreamed answer."""
        return {"dropped_tokens": self.dropped, "prompt_tokens_before": self.before,
                "prompt_tokens_after": self.after, "keep_tokens": self.keep}

    def headers(self) -> dict[str, str]:
        return {HEADER: f"dropped={self.dropped}; before={self.before}; after={self.after}; keep={self.keep}"}


def check_policy(policy: str, keep: int) -> tuple[str, int]:
    """``(policy, keep)`` when they are valid, else a :class:`KvrtError` naming them."""
    if policy not in POLICIES or isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise KvrtError(f"context_policy must be one of {POLICIES} and keep_tokens an integer >= 0, got {policy!r} "
                        f"and {keep!r}")
    return policy, keep


def shift_prompt(prompt: list[int], config: EngineConfig, *, n: int, max_tokens: int,
                 keep: int) -> tuple[list[int], ContextShift | None]:
    """``prompt`` made to fit a request's cells of an engine of ``config`` beside ``n`` choices of ``max_tokens``
    (counted as :func:`kvrt.runtime.admission.check_fits` counts them): unchanged (and ``None``) when it fits, else
    its first ``keep`` tokens and as many of its last ones as fit. A 400 when ``keep`` and the output leave no room
    for any recent token."""
    n_cells = config.request_cells
    out_cells = max_tokens * (1 if config.kv_layout == "split" else n)  # split: each choice in a slot of its own
    room = n_cells - out_cells
    if len(prompt) <= room:
        return prompt, None
    if room <= keep:
        raise ApiError(400, f"the prompt ({len(prompt)} tokens) does not fit the request's {n_cells} cells, and "
                            f"after {out_cells} cells of output (max_tokens x choices) and the {keep} kept tokens "
                            "(kvrt serve --keep-tokens) none are left for its recent tokens; lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    shifted = prompt[:keep] + prompt[len(prompt) - (room - keep):]
    return shifted, ContextShift(len(prompt), len(shifted), keep)
