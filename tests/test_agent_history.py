"""An agent's history is exactly its transcript, after any turns, swaps, forks and growths (demo model).

The reference is independent of the scheduler (tests/_reference.py): a fresh llama.cpp
context prefills the whole transcript in one go; turn-by-turn decoding, swaps through host
memory and moves into larger contexts must give its greedy tokens, and the agent's KV must
hold exactly its transcript. Models load without CPU extra buffer types: their repacked
kernels round a one-token decode (gemv) very differently from a many-token prefill (gemm).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from _reference import check_greedy
from kvrt.accounting.estimate import ModelShape, context_estimate
from kvrt.accounting.ledger import VramLedger
from kvrt.engine.model import Model
from kvrt.serve.registry import ModelRegistry
from kvrt.serve.residency import Switch
from kvrt.serve.scheduler import Scheduler

N_CTX = 1024
PROBE = " In one word, the colour of the sky is"
TURNS = ["Write a short line about a fox.", " Now one about a dog.", " And a cat?", " Which of them is fastest?"]


@contextmanager
def scheduler(ledger: VramLedger) -> Iterator[Scheduler]:
    registry = ModelRegistry(ledger, use_extra_bufts=False)
    try:
        with Scheduler(ledger, registry, n_threads=1, flash_attn="off") as sched:
            yield sched
    finally:
        registry.close()


def one_live_context(path: Path) -> VramLedger:
    """Room for the weights and one context of N_CTX cells: every switch between agents swaps."""
    shape = ModelShape.read(path)
    return VramLedger(shape.weight_bytes(on_gpu=False) + context_estimate(shape, N_CTX).total_bytes)


def kv_tokens(sched: Scheduler, agent_id: str) -> int:
    """Tokens the agent's KV holds, read from llama.cpp (restored into a live context first)."""
    def read() -> int:
        agent = sched._agents[agent_id]
        sched.residency.activate(agent, Switch())
        assert agent.context is not None
        return agent.context.seq_len(0)
    return sched._call(read)


def expected_transcript(model: Model, prompts: list[str], outputs: list[list[int]], got: list[int]) -> list[int]:
    """What the history must be, built from the prompts and replies alone (an ending eog token read from ``got``)."""
    out: list[int] = []
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        out += model.tokenize(prompt, add_special=i == 0) + tokens
        if len(got) > len(out) and model.is_eog(got[len(out)]):
            out.append(got[len(out)])
    return out


def test_many_turns_with_swaps_forks_and_growth_equal_a_recompute(demo_model_path):
    with scheduler(one_live_context(demo_model_path)) as sched:
        sched.register("a", demo_model_path, N_CTX)
        sched.register("b", demo_model_path, N_CTX)
        sched.register("g", demo_model_path, N_CTX, policy="grow", min_ctx=256)
        prompts: dict[str, list[str]] = {"a": [], "b": [], "g": []}
        outputs: dict[str, list[list[int]]] = {"a": [], "b": [], "g": []}
        restored = 0
        for i, turn in enumerate(TURNS):
            for agent in ("a", "b", "g"):
                result = sched.decode(agent, turn, 64 if agent == "g" else 12)
                restored += result.restored
                prompts[agent].append(turn)
                outputs[agent].append(result.tokens)
            if i == 1:
                sched.fork("a", "a2")
                prompts["a2"], outputs["a2"] = list(prompts["a"]), list(outputs["a"])
            elif i > 1:
                result = sched.decode("a2", " Say it differently.", 8)
                prompts["a2"].append(" Say it differently.")
                outputs["a2"].append(result.tokens)
        assert restored >= len(TURNS) * 2  # the agents really went out and came back in
        grown = {a.agent_id: a.n_ctx for a in sched.agents()}["g"]
        assert grown > 256  # the growing agent moved into a larger context on the way
        with Model(demo_model_path, use_extra_bufts=False) as model:
            transcripts = {agent: sched.transcript(agent) for agent in ("a", "b", "g", "a2")}
            for agent, transcript in transcripts.items():
                assert transcript == expected_transcript(model, prompts[agent], outputs[agent], transcript)
        for agent, transcript in transcripts.items():
            assert kv_tokens(sched, agent) == len(transcript) - 1  # all of it but the last token sampled
            check_greedy(demo_model_path, transcript, PROBE, sched.decode(agent, PROBE, 12).tokens, agent)


def test_a_failed_turn_leaves_the_history_as_it_was(demo_model_path):
    with scheduler(VramLedger(1 << 34)) as sched:
        sched.register("a", demo_model_path, 256)
        first = sched.decode("a", "Hello there.", 6)
        before = sched.transcript("a")
        with pytest.raises(Exception, match="exceeds its n_ctx 256"):
            sched.decode("a", " again" * 10, 250)
        assert sched.transcript("a") == before
        assert kv_tokens(sched, "a") == len(before) - 1
        check_greedy(demo_model_path, before, PROBE, sched.decode("a", PROBE, 8).tokens)
        assert first.tokens
