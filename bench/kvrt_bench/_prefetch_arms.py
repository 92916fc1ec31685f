"""The workload and the three arms of ``kvrt bench prefetch`` (see that harness's docstring): agents' histories
prefilled once and captured, and one round of each arm (sync, prefetch, resident) over them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams, generate, prefill
from kvrt.engine.model import Model
from kvrt.errors import KvrtError
from kvrt.state.hostpool import HostPool
from kvrt.state.snapshot import Snapshot
from kvrt.state.staging import KVStager, PendingSnapshot
from kvrt_bench._swap import document


def token_range(text: str) -> tuple[int, int]:
    """``LO-HI`` as two ints with 2 <= LO <= HI; a clear error otherwise."""
    try:
        lo, hi = (int(part) for part in text.split("-"))
    except ValueError:
        raise KvrtError(f"--tokens must be LO-HI (two integers), got {text!r}") from None
    if not 2 <= lo <= hi:
        raise KvrtError(f"--tokens needs 2 <= LO <= HI, got {lo}-{hi}")
    return lo, hi


def lengths(n_agents: int, lo: int, hi: int) -> list[int]:
    """History lengths spread evenly over [lo, hi], interleaved long and short (as a queue would mix them)."""
    spread = [lo + (hi - lo) * i // max(n_agents - 1, 1) for i in range(n_agents)]
    return [spread[i // 2] if i % 2 == 0 else spread[n_agents - 1 - i // 2] for i in range(n_agents)]


@dataclass
class Activation:
    """One agent's turn in a swapping arm: its state's size and what moving it cost (ms)."""

    arm: str
    round: int
    agent: int
    n_tokens: int
    nbytes: int
    swap_in_ms: float  # sync: the restore on the decode path; prefetch: the copy on the copy-in thread
    exposed_ms: float  # what the decode path waited for the agent's state
    swap_out_ms: float  # sync: on the decode path; prefetch: on the copy-out thread
    ideal_ms: float = 0.0


@dataclass
class ArmRun:
    """One arm's rounds: wall time of each, the turns it served (per agent, turn after turn), its activations."""

    round_ms: list[float] = field(default_factory=list)
    turns: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (turn index, agent) -> tokens
    activations: list[Activation] = field(default_factory=list)


class Workload:
    """The agents: one conversation the swapping arms take turns to advance through host snapshots, and the
    same agents resident in contexts of their own (the yardstick), each turn served once by each side."""

    def __init__(self, model: Model, args: argparse.Namespace, flash_attn: str, pool: HostPool) -> None:
        lo, hi = token_range(args.tokens)
        self.model = model
        self.pool = pool
        self.lengths = lengths(args.agents, lo, hi)
        self.per_turn = GenerationParams(max_tokens=args.decode_tokens)
        self.rounds = args.rounds
        extra = 2 * args.rounds * args.decode_tokens + 8

        def params(n_ctx: int) -> ContextParams:
            return ContextParams(n_ctx=n_ctx, n_batch=16, n_ubatch=16, n_threads=args.threads, flash_attn=flash_attn)

        self.params = params(hi + extra)  # the swapping arms' contexts: room for the longest agent
        doc = document(model, hi)
        self.swapped_pending = [doc[n - 1] for n in self.lengths]
        self.resident_pending = list(self.swapped_pending)
        self.resident = [Context(model, params(n + extra)) for n in self.lengths]
        captured: dict[int, Snapshot] = {}
        builder = ContextParams(n_ctx=hi, n_batch=args.prefill_batch, n_ubatch=min(args.prefill_batch, 512),
                                n_threads=args.threads, flash_attn=flash_attn)
        with Context(model, builder) as ctx:
            done = 0
            for n in sorted(set(self.lengths)):
                prefill(ctx, doc[done:n - 1], logits_last=False)
                done = n - 1
                for agent, length in enumerate(self.lengths):
                    if length == n:
                        captured[agent] = Snapshot.capture(ctx, 0, pool=pool)
                        captured[agent].restore(self.resident[agent], 0)
        self.states = [captured[agent] for agent in range(len(self.lengths))]
        print(f"prefetch [{flash_attn}]: {len(self.lengths)} agents prefilled to {lo}-{hi} tokens", flush=True)
        self.state_bytes = [s.nbytes for s in self.states]

    def turn(self, ctx: Context, pending: list[int], agent: int) -> list[int]:
        """The agent's next turn in ``ctx``: its pending token decoded, greedy successors; the last one is pending."""
        sampled = generate(ctx, [pending[agent]], self.per_turn).sampled
        pending[agent] = sampled[-1]
        return sampled

    def close(self) -> None:
        for state in self.states:
            state.release()
        for ctx in self.resident:
            ctx.close()


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def sync_round(work: Workload, ctx: Context, run: ArmRun, r: int, turn: int) -> None:
    """Restore, decode, capture, for every agent in turn: each swap on the decode path, in one context."""
    t_round = time.perf_counter()
    for agent, state in enumerate(work.states):
        t0 = time.perf_counter()
        state.restore(ctx, 0)
        swap_in = _ms(t0)
        run.turns[turn, agent] = work.turn(ctx, work.swapped_pending, agent)
        t1 = time.perf_counter()
        work.states[agent] = Snapshot.capture(ctx, 0, pool=work.pool)
        ctx.seq_rm(0)
        run.activations.append(Activation("sync", r, agent, state.n_tokens, state.nbytes, swap_in, swap_in, _ms(t1)))
        state.release()
    run.round_ms.append(_ms(t_round))


def prefetch_round(work: Workload, stager: KVStager, run: ArmRun, r: int, turn: int) -> None:
    """The next agent prefetched while the current one decodes (the first one before the clock starts: known one
    turn ahead); swap-outs on the copy-out thread, all finished inside the round."""
    states = work.states
    handle = stager.prefetch(states[0])
    t_round = time.perf_counter()
    captures: list[PendingSnapshot] = []
    for agent in range(len(states)):
        ctx = stager.activate(handle)
        record = handle.record
        assert record is not None
        states[agent].release()  # restored: its host copy is no longer needed
        if agent + 1 < len(states):
            handle = stager.prefetch(states[agent + 1])
        run.turns[turn, agent] = work.turn(ctx, work.swapped_pending, agent)
        captures.append(stager.swap_out_async(ctx))
        run.activations.append(Activation("prefetch", r, agent, record.n_tokens, record.nbytes, record.restore_ms,
                                          record.exposed_ms, 0.0))
    for agent, capture in enumerate(captures):
        states[agent] = capture.result()
    run.round_ms.append(_ms(t_round))
    for activation, capture in zip(run.activations[-len(captures):], captures, strict=True):
        activation.swap_out_ms = capture.record.capture_ms


def resident_round(work: Workload, run: ArmRun, turn: int) -> None:
    """Every agent in its own context: only the decode."""
    t_round = time.perf_counter()
    for agent, ctx in enumerate(work.resident):
        run.turns[turn, agent] = work.turn(ctx, work.resident_pending, agent)
    run.round_ms.append(_ms(t_round))
