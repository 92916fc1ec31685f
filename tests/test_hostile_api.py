"""A hostile caller of the Python API: agent services (both modes) given wrong ids, sizes, budgets, agents
and calls after close; snapshots restored into the wrong model. Each is refused with an error naming what was
wrong, and the agent admitted before continues exactly as in a service nobody attacked (CPU, tiny models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams, generate
from kvrt.engine.model import Model
from kvrt.errors import KvrtError
from kvrt.serve.results import AgentExists, SchedulerClosed, UnknownAgent
from kvrt.state.snapshot import Snapshot, SnapshotMismatch
from test_daemon import N_CTX
from test_hostile_state import service

TURNS = ("once upon a time", "the end")


def bad_calls(model: Path) -> list[tuple[str, object, type[BaseException], str | tuple[str, ...]]]:
    """(what, the call, the error it must raise, words its message must hold one of)."""
    return [
        ("id with a slash", lambda s: s.register("a/b", model, N_CTX), KvrtError, "'a/b'"),
        ("empty id", lambda s: s.register("", model, N_CTX), KvrtError, "agent id"),
        ("id not a string", lambda s: s.register(5, model, N_CTX), KvrtError, "agent id"),
        ("n_ctx zero", lambda s: s.register("x", model, 0), KvrtError, "n_ctx"),
        ("n_ctx negative", lambda s: s.register("x", model, -3), KvrtError, "n_ctx"),
        ("n_ctx a bool", lambda s: s.register("x", model, True), KvrtError, "n_ctx"),
        ("n_ctx a string", lambda s: s.register("x", model, "512"), KvrtError, "n_ctx"),
        ("n_ctx past any budget", lambda s: s.register("x", model, 1 << 40), KvrtError, ("does not fit", str(1 << 40))),
        ("unknown policy", lambda s: s.register("x", model, N_CTX, policy="evict"), KvrtError, "evict"),
        ("no such model", lambda s: s.register("x", model.with_name("none.gguf"), N_CTX), KvrtError, "none.gguf"),
        ("a directory for a model", lambda s: s.register("x", model.parent, N_CTX), KvrtError, "regular file"),
        ("taken id", lambda s: s.register("keep", model, N_CTX), AgentExists, "'keep'"),
        ("unknown agent", lambda s: s.decode("nobody", "hi", 2), UnknownAgent, "'nobody'"),
        ("zero tokens", lambda s: s.decode("keep", "hi", 0), KvrtError, "max_tokens"),
        ("negative tokens", lambda s: s.decode("keep", "hi", -1), KvrtError, "max_tokens"),
        ("more tokens than the context", lambda s: s.decode("keep", "hi", 100_000), KvrtError, str(N_CTX)),
        ("token ids outside the vocabulary", lambda s: s.decode("keep", [10**9], 2), KvrtError, str(10**9)),
        ("fork onto a taken id", lambda s: s.fork("keep", "keep"), AgentExists, "'keep'"),
        ("fork of nobody", lambda s: s.fork("nobody", "y"), UnknownAgent, "'nobody'"),
        ("unregister nobody", lambda s: s.unregister("nobody"), UnknownAgent, "'nobody'"),
        ("cancel nobody", lambda s: s.cancel("nobody"), UnknownAgent, "'nobody'"),
    ]


@pytest.mark.parametrize("mode", ["per-agent", "batched"])
def test_bad_calls_are_refused_by_name_and_cost_nothing(mode, tmp_path, tiny_model_path):
    with service(mode, tmp_path / "reference") as sched:
        sched.register("keep", tiny_model_path, N_CTX)
        reference = [sched.decode("keep", turn, 4).tokens for turn in TURNS]
    with service(mode, tmp_path / "state") as sched:
        sched.register("keep", tiny_model_path, N_CTX)
        first = sched.decode("keep", TURNS[0], 4).tokens
        for what, call, error, word in bad_calls(tiny_model_path):
            with pytest.raises(error) as refused:
                call(sched)  # type: ignore[operator]
            words = (word,) if isinstance(word, str) else word
            assert any(w in str(refused.value) for w in words), f"{what}: {refused.value}"
        assert [a.agent_id for a in sched.agents()] == ["keep"]
        assert [first, sched.decode("keep", TURNS[1], 4).tokens] == reference
        transcript = sched.transcript("keep")
    with pytest.raises(SchedulerClosed, match="shutting down"):
        sched.decode("keep", "after close", 2)
    with service(mode, tmp_path / "state") as again:
        assert again.state_problems == [] and again.transcript("keep") == transcript


def test_a_snapshot_restored_into_another_model_is_refused_and_the_target_kept(tiny_model, other_tiny_model_path):
    params = ContextParams(n_ctx=256, n_threads=1)
    with Context(tiny_model, params) as ctx, Model(other_tiny_model_path) as other, Context(other, params) as target:
        generate(ctx, [1, 5, 9, 12], GenerationParams(max_tokens=3))
        generate(target, [1, 7], GenerationParams(max_tokens=2))
        held = target.seq_len(0)
        with Snapshot.capture(ctx, 0) as snapshot:
            with pytest.raises(SnapshotMismatch, match=f"cannot be restored into {other.path.name!r}: content"):
                snapshot.restore(target, 0)
        assert target.seq_len(0) == held
