"""A branch of a fan-out: its prompt and generation parameters, its result, and the error of a bad request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrt.checks import check_text, shown
from kvrt.engine.generation import Completion, GenerationParams
from kvrt.engine.model import Model
from kvrt.errors import KvrtError


class FanoutError(KvrtError):
    """A fan-out request that cannot run (empty, over budget, bad mode)."""


@dataclass(frozen=True)
class Branch:
    """One continuation of the shared document: a prompt and how to generate after it.

    Checked on construction: ``prompt`` non-empty text UTF-8 can encode, ``params`` a
    :class:`GenerationParams`, ``name`` a string.
    """

    prompt: str
    params: GenerationParams = field(default_factory=GenerationParams)
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise FanoutError(f"a branch's name must be a str, got {shown(self.name)}")
        check_text(self.prompt, f"branch {self.name!r} prompt" if self.name else "branch prompt", error=FanoutError)
        if not isinstance(self.params, GenerationParams):
            raise FanoutError(f"branch params must be a GenerationParams, got {shown(self.params)}")


@dataclass
class BranchResult:
    """A branch's completion and its timings.

    ``activation_ms`` is the branch-specific work before its first token (isolated:
    context lease + restore + prompt + first sample, the first branch only prompt +
    first sample in the prefill context; shared: prompt + first sample, counted from the
    start of the branch phase, or with ``exact=True`` from the branch's own start, since
    the branches then run one after another) - the seed's "branch activation latency".
    ``restore_ms`` isolates the state transfer within it: context lease + snapshot
    restore, the part that moves KV bytes (0 where nothing is restored).
    """

    name: str
    completion: Completion
    activation_ms: float
    total_ms: float
    restore_ms: float = 0.0

    @property
    def text(self) -> str:
        return self.completion.text


def branch_budget(model: Model, branch: Branch) -> tuple[list[int], int]:
    """The branch's prompt tokens and the cells it needs (prompt + max_tokens)."""
    tokens = model.tokenize(branch.prompt, add_special=False)
    if not tokens:
        raise FanoutError(f"branch {branch.name or branch.prompt!r} has an empty prompt")
    return tokens, len(tokens) + branch.params.max_tokens
