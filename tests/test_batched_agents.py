"""Agents decoded together (BatchedScheduler): exact histories, one batch per step, streaming, cancel, deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from _reference import check_greedy
from kvrt.accounting.ledger import VramLedger
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, generate
from kvrt.engine.model import Model
from kvrt.engine.sampling import SamplingParams
from kvrt.serve.batched import BatchConfig, BatchedScheduler
from kvrt.serve.client import Client
from kvrt.serve.daemon import Daemon
from kvrt.serve.registry import ModelRegistry
from kvrt.serve.results import ContextFull

TURNS = ["Write a short line about a fox.", " Now one about a dog.", " And a cat?"]
PROBE = " In one word, the colour of the sky is"


@contextmanager
def batched(cells: int = 4096, slots: int = 8, flash_attn: str = "off") -> Iterator[BatchedScheduler]:
    ledger = VramLedger(1 << 34)
    registry = ModelRegistry(ledger, use_extra_bufts=False)  # see test_agent_history: bit-exact kernels only
    try:
        with BatchedScheduler(ledger, registry, config=BatchConfig(n_ctx=cells, n_seq_max=slots, n_threads=1,
                                                                   flash_attn=flash_attn)) as sched:
            yield sched
    finally:
        registry.close()
    assert ledger.allocated_bytes == 0


def engine_of(sched: BatchedScheduler):
    (pool,) = sched._pools.values()
    return pool.engine


@pytest.mark.parametrize("cells", [4096, 512])  # 512: agents' cells are evicted and recomputed between turns
def test_turns_one_at_a_time_and_a_fork_equal_a_recompute(demo_model_path, cells):
    with batched(cells=cells, slots=8) as sched:
        for agent in ("a", "b", "c"):
            sched.register(agent, demo_model_path, 512)
        for i, turn in enumerate(TURNS):
            for agent in ("a", "b", "c"):
                sched.decode(agent, turn, 16)
            if i == 0:
                sched.fork("a", "a2")
                assert sched.transcript("a2") == sched.transcript("a")
        engine = engine_of(sched)
        assert engine.stats().reused_tokens > 0
        transcripts = {agent: sched.transcript(agent) for agent in ("a", "b", "c", "a2")}
        held = [engine.cache.tokens(s) for s in range(8)]
        for agent, transcript in transcripts.items():
            if cells == 4096:  # cells to spare: each agent's last turn left all of it but the last token sampled
                assert transcript[:-1] in held, agent
        for agent, transcript in transcripts.items():
            check_greedy(demo_model_path, transcript, PROBE, sched.decode(agent, PROBE, 12).tokens, agent)


def test_concurrent_agents_share_decode_steps_and_lose_no_token(tiny_model_path):
    n_agents, n_tokens = 6, 24
    with batched(cells=4096, slots=8) as sched:
        for i in range(n_agents):
            sched.register(f"a{i}", tiny_model_path, 1024)
        with Model(tiny_model_path) as model:
            prompts = {f"a{i}": model.tokenize(f"agent {i} says", add_special=True) for i in range(n_agents)}
        before = engine_of(sched).stats().steps
        futures = {a: sched.submit(a, p, n_tokens) for a, p in prompts.items()}
        results = {a: f.result() for a, f in futures.items()}
        steps = engine_of(sched).stats().steps - before
        assert steps < n_agents * n_tokens // 2  # many agents advanced in each decode
        for agent, result in results.items():
            assert result.finish_reason == "length" and len(result.tokens) == n_tokens
            transcript = sched.transcript(agent)
            assert transcript[:-1] == prompts[agent] + result.tokens[:-1]  # its own prompt and reply, nothing else
            assert transcript[-1] == result.tokens[-1]


def test_streamed_pieces_make_the_text_and_sampling_is_per_request(tiny_model_path):
    sampling = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    with batched() as sched:
        sched.register("s", tiny_model_path, 1024)
        pieces: list[str] = []
        result = sched.submit("s", "hello there", 20, sampling=sampling, on_text=pieces.append).result()
        assert "".join(pieces) == result.text and result.tokens
    with Model(tiny_model_path) as model, Context(model, n_ctx=256, n_threads=1, flash_attn="off") as ctx:
        alone = generate(ctx, "hello there", GenerationParams(max_tokens=20, sampling=sampling))
    assert result.tokens == alone.tokens  # the engine's sampler for this request: same chain, same seed


def test_cancel_ends_a_long_turn_between_tokens_and_others_go_on(tiny_model_path):
    with batched() as sched:
        sched.register("long", tiny_model_path, 2048)
        sched.register("short", tiny_model_path, 2048)
        started = threading.Event()
        long = sched.submit("long", "write forever", 1500, on_text=lambda _: started.set())
        queued = sched.submit("long", " and then", 5)
        started.wait()
        short = sched.decode("short", "be brief", 4)
        assert sched.cancel("long") == 2
        ended = long.result()
        assert ended.finish_reason == "cancelled" and 0 < len(ended.tokens) < 1500
        assert queued.result().finish_reason == "cancelled"
        assert short.finish_reason == "length" and len(short.tokens) == 4
        transcript = sched.transcript("long")
        assert transcript[-len(ended.tokens):] == ended.tokens  # what it produced before the cancel is kept
        assert sched.decode("long", " go on", 3).tokens  # the agent still serves


def test_deadline_and_context_limit(tiny_model_path):
    with batched() as sched:
        sched.register("d", tiny_model_path, 256)
        assert sched.submit("d", "late", 8, deadline=time.monotonic() - 1).result().finish_reason == "deadline"
        with pytest.raises(ContextFull, match="exceeds its n_ctx 256"):
            sched.decode("d", "too long", 300)
        sched.register("s", tiny_model_path, 256, policy="shift", keep=4)
        for _ in range(8):
            sched.decode("s", " the quick brown fox jumps over the lazy dog", 40)
            assert len(sched.transcript("s")) <= 256


def test_daemon_streams_tokens_and_cancels(tiny_model_path, tmp_path):
    with batched() as sched:
        server = Daemon(tmp_path / "b.sock", sched).start()
        try:
            with Client(server.path, timeout=60) as client, Client(server.path, timeout=60) as other:
                client.register("a", tiny_model_path, 2048)
                stream = client.stream("a", "hello", 12, temperature=0.0, stop=["zzz"])
                pieces = list(stream)
                assert stream.result is not None and "".join(pieces) == stream.result.text
                assert stream.result.fields["finish_reason"] == "length"
                long = client.stream("a", " go", 1500)
                first = next(long)
                assert other.cancel("a") == 1
                rest = list(long)
                assert long.result is not None and long.result.fields["finish_reason"] == "cancelled"
                assert first + "".join(rest) == long.result.text
                assert client.decode("a", " again", 3, seed=7).fields["generated_tokens"] == "3"
        finally:
            server.stop()


def test_unregistering_the_last_agent_mid_turn_ends_it_and_frees_the_model(tiny_model_path):
    ledger = VramLedger(1 << 34)
    with BatchedScheduler(ledger, config=BatchConfig(n_ctx=2048, n_seq_max=4, n_threads=1)) as sched:
        sched.register("x", tiny_model_path, 2048)
        started = threading.Event()
        turn = sched.submit("x", "write forever", 1500, on_text=lambda _: started.set())
        started.wait()
        sched.unregister("x")
        assert turn.result().finish_reason == "cancelled"
        deadline = time.monotonic() + 60
        while ledger.allocated_bytes and time.monotonic() < deadline:  # the pool is freed off the engine's thread
            time.sleep(0.01)
        assert ledger.allocated_bytes == 0 and sched.agents() == []
        sched.register("x", tiny_model_path, 2048)  # the id and the model can be used again
        assert sched.decode("x", "hello", 3).tokens


def test_a_state_dir_brings_batched_agents_back_with_their_transcripts(tiny_model_path, tmp_path):
    """Agents saved at close come back in a new scheduler on the same directory with exactly their transcripts,
    and continue like a from-scratch prefill of them; an unregistered agent is gone, a damaged file is a problem
    (the others still come back), and the per-agent scheduler refuses these KV-less records by name."""
    from kvrt.serve.scheduler import Scheduler  # noqa: PLC0415
    from kvrt.state.agentstore import MANIFEST_SUFFIX  # noqa: PLC0415

    def scheduler(ledger: VramLedger) -> BatchedScheduler:
        return BatchedScheduler(ledger, config=BatchConfig(n_ctx=2048, n_seq_max=4, n_threads=1, flash_attn="off"),
                                state_dir=tmp_path)

    ledger = VramLedger(1 << 34)
    with scheduler(ledger) as sched:
        for agent in ("a", "b", "c"):
            sched.register(agent, tiny_model_path, 512)
            for turn in TURNS[:2]:
                sched.decode(agent, turn, 6)
        sched.unregister("c")
        saved = {agent: sched.transcript(agent) for agent in ("a", "b")}
    (tmp_path / ("z" + MANIFEST_SUFFIX)).write_text("{not json")
    with scheduler(ledger) as sched:
        assert sched.state_restored == 2 and [p.agent_id for p in sched.state_problems] == ["z"]
        assert {agent: sched.transcript(agent) for agent in ("a", "b")} == saved
        assert {info.agent_id for info in sched.agents()} == {"a", "b"}
        probe = sched.decode("a", PROBE, 8)
        check_greedy(tiny_model_path, saved["a"], PROBE, probe.tokens, "a")
    assert ledger.allocated_bytes == 0
    with Scheduler(VramLedger(1 << 34), n_threads=1, state_dir=tmp_path) as per_agent:
        reasons = {p.agent_id: p.reason for p in per_agent.state_problems}
        assert per_agent.state_restored == 0 and "--batch-slots" in reasons["a"] and "--batch-slots" in reasons["b"]
