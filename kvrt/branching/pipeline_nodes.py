"""What a :class:`kvrt.branching.pipeline.Pipeline` is made of: its nodes, the errors it raises, its result.

A node is a document (prefilled once), a branch (continues a document's first
``need_tokens`` tokens) or a function (of its dependencies' outputs); every node
names its dependencies in ``deps``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrt.branching.branch import Branch
from kvrt.errors import KvrtError

PipelineProgress = Callable[[str, int, int], None]
"""Called as ``progress(document_name, tokens_committed, tokens_total)`` during a prefill."""


class PipelineError(KvrtError):
    """The pipeline is malformed or a node failed."""


class CycleError(PipelineError):
    """The dependencies form a cycle; ``edge`` is the (from, to) pair that closes it."""

    def __init__(self, edge: tuple[str, str], cycle: list[str]) -> None:
        self.edge = edge
        self.cycle = cycle
        super().__init__(f"dependency {edge[0]!r} -> {edge[1]!r} closes a cycle: {' -> '.join(cycle)}")


class BudgetError(PipelineError):
    """A branch cannot fit its document prefix, prompt and generation in one context."""


class DependencyFailed(PipelineError):
    """A node did not run because something it depends on failed (the cause is chained)."""


class NodeFailed(PipelineError):
    """Raised by :meth:`Pipeline.run` when nodes failed; ``result`` holds everything that did finish."""

    def __init__(self, result: PipelineResult) -> None:
        self.result = result
        names = ", ".join(f"{k}: {type(v).__name__}: {v}" for k, v in result.errors.items())
        super().__init__(f"{len(result.errors)} pipeline node(s) failed: {names}")


@dataclass
class DocumentNode:
    name: str
    tokens: list[int]
    deps: tuple[str, ...] = ()


@dataclass
class BranchNode:
    name: str
    branch: Branch
    after: str
    need_tokens: int | None

    @property
    def deps(self) -> tuple[str, ...]:
        return (self.after,)


@dataclass
class FunctionNode:
    name: str
    fn: Callable[[dict[str, Any]], Any]
    deps: tuple[str, ...]


Node = DocumentNode | BranchNode | FunctionNode


@dataclass
class PipelineResult:
    """Outputs of the nodes that finished, errors of those that did not, and per-node timings (ms).

    A document's output is its token count; a branch's its :class:`kvrt.engine.generation.Completion`.
    Timings hold ``start_ms``/``end_ms`` (from the start of ``run``) and kind-specific
    entries: ``prefill_ms`` and ``watermark_ms`` for documents; ``activation_ms``,
    ``restore_ms`` and ``decode_ms`` for branches. ``reused_tokens`` maps each prefilled
    document to how many of its tokens a snapshot cache held, so they were not prefilled.
    """

    outputs: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)
    timings_ms: dict[str, dict[str, Any]] = field(default_factory=dict)
    total_ms: float = 0.0
    reused_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors
