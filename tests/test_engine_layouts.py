"""The batching engine's KV layouts: a stream per slot (split), one pool (unified), and ``auto`` between them.

References: each request alone in a fresh context (:func:`tests.test_batching.alone`);
the tiny F32 model with flash attention off is exact under batching and prefix reuse, so
tokens are compared for equality in both layouts. The engine's counters (prefilled,
reused, restored tokens) say what was computed, and the prefix cache's mirror is checked
against what llama.cpp holds for every slot.
"""

from __future__ import annotations

import random
import time

import pytest

from kvrt.errors import KvrtError
from kvrt.runtime import batching
from kvrt.runtime.admission import EngineConfig, Layout
from kvrt.runtime.batching import Engine
from kvrt.runtime.layout_policy import _roomier
from kvrt.runtime.requests import EngineError, Request, RequestTooLarge
from test_batching import WAIT_S, HoldGate, StepGate, alone, engine, greedy

LAYOUTS = ["split", "unified"]


def private_histories(n_vocab: int, agents: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, n_vocab) for _ in range(length - 1)] for _ in range(agents)]


def assert_mirror_matches_llama_cpp(eng: Engine) -> None:
    for slot in range(eng.cache.n_slots):
        assert eng.ctx.seq_len(slot) == eng.cache.held(slot), f"slot {slot}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dropped", [0, 3])
def test_follow_up_turns_reuse_their_whole_history_with_every_slot_taken(tiny_model, layout, dropped):
    """As many agents as slots, two turns each, all at once. The second turn is the first's prompt, its reply
    (less ``dropped`` final tokens: a client that trims the reply's end) and new tokens: every agent must find
    its own history (nothing any other agent's turn evicted), so only the new tokens are prefilled."""
    agents, gen = 6, 6
    histories = private_histories(tiny_model.n_vocab, agents, 90)
    rng = random.Random(1)
    news = [[rng.randrange(3, tiny_model.n_vocab) for _ in range(12)] for _ in range(agents)]
    with engine(tiny_model, n_ctx=agents * 256, n_seq_max=agents, n_batch=128, kv_layout=layout) as eng:
        replies = [s.result(WAIT_S).choices[0].tokens
                   for s in [eng.submit(Request(h, greedy(gen))) for h in histories]]
        before = eng.stats()
        turns = [h + r[:len(r) - dropped] + n for h, r, n in zip(histories, replies, news)]
        seconds = [s.result(WAIT_S) for s in [eng.submit(Request(t, greedy(gen))) for t in turns]]
        after = eng.stats()
        assert after.kv_layout == layout
        assert_mirror_matches_llama_cpp(eng)
    # the last reply token: never decoded
    kept = [len(h) + len(r) - max(dropped, 1) for h, r in zip(histories, replies)]
    assert [s.end.cached_tokens for s in seconds] == kept
    assert after.prefilled_tokens - before.prefilled_tokens == sum(len(t) - k for t, k in zip(turns, kept))
    assert [s.choices[0].tokens for s in seconds] == [alone(tiny_model, t, greedy(gen)) for t in turns]


def test_split_streams_share_a_preamble_by_copy_and_fork_choices_once_the_prompt_is_in(tiny_model):
    """Split layout: requests starting with one preamble copy the first one's stream instead of prefilling it, and
    ``n`` greedy choices fork the prompt once it is in; every choice equals the request alone."""
    preamble = private_histories(tiny_model.n_vocab, 1, 120, seed=2)[0]
    tails = private_histories(tiny_model.n_vocab, 3, 10, seed=3)
    prompts = [preamble + t[1:] for t in tails]
    with engine(tiny_model, n_ctx=4 * 256, n_seq_max=4, n_batch=64, prefill_chunk=32, kv_layout="split") as eng:
        first = eng.submit(Request(prompts[0], greedy(5))).result(WAIT_S)
        rest = [eng.submit(Request(p, greedy(5))).result(WAIT_S) for p in prompts[1:]]
        forked = eng.submit(Request(prompts[2] + [7, 8, 9], greedy(5), n=3)).result(WAIT_S)
        assert eng.stats().kv_layout == "split"
        assert_mirror_matches_llama_cpp(eng)
    assert [r.end.cached_tokens for r in rest] == [len(preamble), len(preamble)]
    for prompt, result in zip(prompts, [first, *rest]):
        assert result.choices[0].tokens == alone(tiny_model, prompt, greedy(5))
    reference = alone(tiny_model, prompts[2] + [7, 8, 9], greedy(5))
    assert [c.tokens for c in forked.choices] == [reference] * 3


def test_auto_turns_unified_for_a_request_longer_than_a_slot_and_split_again_when_idle(tiny_model):
    short = private_histories(tiny_model.n_vocab, 2, 40, seed=4)
    long = private_histories(tiny_model.n_vocab, 1, 400, seed=5)[0]  # more than a slot's 256 cells
    with engine(tiny_model, n_ctx=512, n_seq_max=2, n_batch=64, kv_layout="auto", split_after_idle_s=0) as eng:
        assert eng.stats().kv_layout == "split"
        small = eng.submit(Request(short[0], greedy(4))).result(WAIT_S)
        assert eng.stats().relayout_s == 0.0
        big = eng.submit(Request(long, greedy(4))).result(WAIT_S)
        stats = eng.stats()
        assert (stats.kv_layout, stats.slot_cells, stats.relayouts) == ("unified", 512, 1)
        assert stats.relayout_s > 0.0  # the worker's time recreating the context, counted
        # the long history stays cached, so the context stays unified; two short ones evict it (LRU)
        for history in short:
            eng.submit(Request(history + [5, 6], greedy(4))).result(WAIT_S)
        deadline = time.monotonic() + WAIT_S  # the idle worker makes it split within a step or two
        while eng.stats().kv_layout != "split" and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = eng.stats()
        assert (stats.kv_layout, stats.slot_cells, stats.relayouts) == ("split", 256, 2)
        again = eng.submit(Request(short[1] + [5, 6, 7], greedy(4))).result(WAIT_S)
        assert_mirror_matches_llama_cpp(eng)
    assert small.choices[0].tokens == alone(tiny_model, short[0], greedy(4))
    assert big.choices[0].tokens == alone(tiny_model, long, greedy(4))
    assert again.choices[0].tokens == alone(tiny_model, short[1] + [5, 6, 7], greedy(4))


def test_auto_makes_a_switch_as_soon_as_it_is_chosen(tiny_model, monkeypatch):
    """Two requests longer than a slot, sharing a document, arrive together: the worker chooses one pool for them
    and recreates the context in the same turn of its loop, not after an idle wait (made an hour long here, so
    waiting for it would leave them waiting past ``WAIT_S``); then two private ones turn it split again."""
    monkeypatch.setattr(batching, "_IDLE_WAIT_S", 3600.0)
    doc = private_histories(tiny_model.n_vocab, 1, 300, seed=12)[0]  # more than a slot's 256 cells
    prompts = [doc + tail[1:] for tail in private_histories(tiny_model.n_vocab, 2, 9, seed=13)]
    short = private_histories(tiny_model.n_vocab, 2, 40, seed=14)
    with engine(tiny_model, n_ctx=512, n_seq_max=2, n_batch=64, kv_layout="auto", split_after_idle_s=3600) as eng:
        shared = [s.result(WAIT_S) for s in [eng.submit(Request(p, greedy(3))) for p in prompts]]
        pooled = eng.stats()
        private = [s.result(WAIT_S) for s in [eng.submit(Request(p, greedy(3))) for p in short]]
        split = eng.stats()
    assert (pooled.kv_layout, pooled.relayouts, split.kv_layout, split.relayouts) == ("unified", 1, "split", 2)
    for prompt, result in zip(prompts + short, shared + private):
        assert result.choices[0].tokens == alone(tiny_model, prompt, greedy(3))


def test_auto_stays_unified_through_pauses_shorter_than_split_after_idle_s(tiny_model):
    """A switch drops the cache, so pauses between an agent's turns must not trigger one."""
    long = private_histories(tiny_model.n_vocab, 1, 400, seed=10)[0]
    short = [h[1:] for h in private_histories(tiny_model.n_vocab, 2, 30, seed=11)]
    with engine(tiny_model, n_ctx=512, n_seq_max=2, n_batch=64, split_after_idle_s=3600,
                hold_s=0) as eng:  # the new agent evicts the long one at once, not after its hold
        first = [eng.submit(Request(p, greedy(2))) for p in (long, short[0])]  # the short one joins the pool
        returning = short[0] + first[1].result(WAIT_S).choices[0].tokens
        first[0].result(WAIT_S)
        # an agent's next turn keeps the pool; a new agent joins it while that turn runs and evicts the long one
        for stream in [eng.submit(Request(p, greedy(2))) for p in (returning, short[1])]:
            stream.result(WAIT_S)
        time.sleep(1.5)  # three idle wake-ups of the worker: only the pause keeps it unified
        stats = eng.stats()
        assert all(eng.cache.held(slot) <= 256 for slot in range(2))
    assert (stats.kv_layout, stats.relayouts) == ("unified", 1)
    with pytest.raises(EngineError, match="split_after_idle_s must be a finite number >= 0"):
        EngineConfig(split_after_idle_s=-1.0)


def test_a_switch_drops_the_cache_and_a_returning_conversation_is_prefilled_exactly(tiny_model):
    """llama.cpp refuses a sequence state saved in the other layout (its stream count differs): the switch
    drops the host tier's copies, so the next turn is prefilled (not restored), with the right tokens."""
    short = private_histories(tiny_model.n_vocab, 1, 60, seed=6)[0]
    long = private_histories(tiny_model.n_vocab, 1, 400, seed=7)[0]
    # no write-behind: a copy of the last turn's slot made while the engine idles would race the tier's count
    with engine(tiny_model, n_ctx=512, n_seq_max=2, n_batch=64, host_bytes=1 << 26, host_write_behind=False) as eng:
        reply = eng.submit(Request(short, greedy(4))).result(WAIT_S).choices[0].tokens
        eng.submit(Request(long, greedy(4))).result(WAIT_S)
        turn = short + reply + [9, 10]
        before = eng.stats()
        again = eng.submit(Request(turn, greedy(4))).result(WAIT_S)
        after = eng.stats()
        assert len(eng.cache.host) == 0
    assert (before.relayouts, after.restored_tokens) == (1, 0)
    # the pool holds only the BOS of the turn (shared with the long history): it turns split again for it
    assert (again.end.cached_tokens, after.relayouts, after.kv_layout) == (0, 2, "split")
    assert again.choices[0].tokens == alone(tiny_model, turn, greedy(4))


def test_a_fixed_split_layout_refuses_what_exceeds_a_slot_naming_the_limit(tiny_model):
    with engine(tiny_model, n_ctx=1024, n_seq_max=4, kv_layout="split") as eng:
        with pytest.raises(RequestTooLarge, match=r"exceeds a slot's 256 cells \(kv_layout 'split': 1024 cells over 4"):
            eng.submit(Request(list(range(1, 250)), greedy(16)))
        ok = eng.submit(Request([1, 2, 3], greedy(4))).result(WAIT_S)  # nothing else was disturbed
    assert len(ok.choices[0].tokens) == 4


def test_pins_keep_the_split_layout_and_a_longer_request_is_refused(tiny_model):
    with engine(tiny_model, n_ctx=512, n_seq_max=2, n_batch=64) as eng:
        pin = eng.pin([1, 5, 6, 7])
        pin.result(WAIT_S)
        with pytest.raises(RequestTooLarge, match="pinned prefixes keep the context split; unpin them"):
            eng.submit(Request(list(range(3, 400)), greedy(4))).result(WAIT_S)
        assert eng.stats().kv_layout == "split"
        assert eng.unpin(pin.id).result(WAIT_S)


def test_layout_configuration_is_checked_before_anything_is_allocated(tiny_model):
    with pytest.raises(EngineError, match="kv_layout must be one of auto, split, unified"):
        EngineConfig(kv_layout="paged")
    with pytest.raises(EngineError, match="n_ctx=512 leaves none; give at least 1024 cells"):
        EngineConfig(n_ctx=512, n_seq_max=4, kv_layout="split")
    assert EngineConfig(n_ctx=512, n_seq_max=4).starts_shared()  # auto: too few cells to split
    assert EngineConfig(n_ctx=163840, n_seq_max=32).split_cells == 5120


def test_a_partial_copy_between_streams_is_refused_before_llama_cpp_asserts(tiny_model):
    from kvrt.engine.context import Context
    from kvrt.engine.context_params import ContextParams

    with Context(tiny_model, ContextParams(n_ctx=512, n_seq_max=2, kv_unified=False)) as ctx:
        with pytest.raises(KvrtError, match="copies whole sequences only"):
            ctx.seq_cp(0, 1, 0, 10)
        ctx.seq_cp(0, 1)  # a whole sequence is fine


def test_requests_submitted_while_the_layout_switches_all_complete(tiny_model):
    """Other threads read the engine (cells, stats) and submit while the worker recreates the context back and
    forth: nothing they touch may be the context being freed (the H200 peer run answered 'context was already
    freed' to 20 of 32 requests before n_cells stopped reading the context)."""
    import threading

    short = [h[1:] for h in private_histories(tiny_model.n_vocab, 2, 30, seed=8)]  # nothing shared with the long
    long = private_histories(tiny_model.n_vocab, 3, 400, seed=9)
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader(eng: Engine) -> None:
        while not stop.is_set():
            try:
                assert eng.n_cells == 512
                eng.stats()
            except BaseException as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)
                return

    with engine(tiny_model, n_ctx=512, n_seq_max=2, n_batch=64, split_after_idle_s=0) as eng:
        thread = threading.Thread(target=reader, args=(eng,))
        thread.start()
        try:
            results = []
            for big in long:  # each long request turns the context unified; two short ones evict it, idle: split
                for prompt in [big, *short]:
                    results.append(eng.submit(Request(prompt, greedy(2))).result(WAIT_S))
                deadline = time.monotonic() + WAIT_S
                while eng.stats().kv_layout != "split" and time.monotonic() < deadline:
                    time.sleep(0.01)
            switches = eng.stats().relayouts
        finally:
            stop.set()
            thread.join()
    assert not errors
    assert all(r.end.error is None and len(r.choices[0].tokens) == 2 for r in results)
    assert switches == 2 * len(long)


def test_auto_turns_split_at_once_for_fresh_requests_but_keeps_the_pool_for_a_returning_turn(tiny_model):
    """With nothing running, a unified context turns split for a request that fits a slot and finds less than
    half of its prompt cached (new agents: the pool's attention over every cell is their cost), without waiting
    for ``split_after_idle_s`` and although a conversation longer than a slot is still cached; an agent's next
    turn, whose history the pool holds, keeps it."""
    long = private_histories(tiny_model.n_vocab, 1, 300, seed=12)[0]  # more than a slot's 256 cells
    short = private_histories(tiny_model.n_vocab, 1, 60, seed=13)[0]
    with engine(tiny_model, n_ctx=512, n_seq_max=2, n_batch=64, split_after_idle_s=3600) as eng:
        together = [eng.submit(Request(p, greedy(4))) for p in (long, short)]  # the short one joins the pool
        reply = [s.result(WAIT_S) for s in together][1].choices[0].tokens
        returning = short + reply + [7, 8]
        kept = eng.submit(Request(returning, greedy(4))).result(WAIT_S)
        assert (eng.stats().kv_layout, eng.stats().relayouts) == ("unified", 1)
        fresh_prompt = private_histories(tiny_model.n_vocab, 1, 50, seed=14)[0]
        fresh = eng.submit(Request(fresh_prompt, greedy(4))).result(WAIT_S)
        stats = eng.stats()
        assert_mirror_matches_llama_cpp(eng)
    assert kept.end.cached_tokens == len(short) + len(reply) - 1
    assert (stats.kv_layout, stats.slot_cells, stats.relayouts) == ("split", 256, 2)
    assert kept.choices[0].tokens == alone(tiny_model, returning, greedy(4))
    assert fresh.choices[0].tokens == alone(tiny_model, fresh_prompt, greedy(4))


def test_auto_splits_into_fewer_longer_streams_for_private_histories_longer_than_a_slot(tiny_model):
    """Four agents whose own histories exceed a slot's 256 cells, all at once: one pool would make each attend
    over all four histories, so ``auto`` makes two streams of 512 (the other two agents queue), and returns to
    four streams of 256 for a short new request once idle. The second turns of the two agents whose histories
    the streams still hold continue them, placed ahead of the two queued before them (which would evict them).
    Every answer, first and second turns, equals the request alone."""
    histories = private_histories(tiny_model.n_vocab, 4, 280, seed=20)
    new = private_histories(tiny_model.n_vocab, 1, 40, seed=23)[0]
    gate = StepGate()
    with engine(tiny_model, gate, n_ctx=1024, n_seq_max=4, split_after_idle_s=0) as eng:
        firsts = [eng.submit(Request(h, greedy(6))) for h in histories]  # all queued before the worker looks
        gate.open()
        replies = [s.result(WAIT_S).choices[0].tokens for s in firsts]
        wide = eng.stats()
        assert_mirror_matches_llama_cpp(eng)
        turns = [h + r + [7, 8, 9] for h, r in zip(histories, replies)]
        seconds = [s.result(WAIT_S) for s in [eng.submit(Request(t, greedy(6))) for t in turns]]
        short = eng.submit(Request(new, greedy(4))).result(WAIT_S)
        back = eng.stats()
        assert_mirror_matches_llama_cpp(eng)
    assert (wide.kv_layout, wide.slot_cells, len(wide.slots), wide.relayouts) == ("split", 512, 2, 1)
    assert (back.kv_layout, back.slot_cells, len(back.slots), back.relayouts) == ("split", 256, 4, 2)
    held = [len(h) + len(r) - 1 for h, r in zip(histories, replies)]  # all but the last sampled token
    assert [s.end.cached_tokens for s in seconds] == [1, 1, *held[2:]]  # the first two ran first: 2 and 3 held
    assert replies == [alone(tiny_model, h, greedy(6)) for h in histories]
    assert [s.choices[0].tokens for s in seconds] == [alone(tiny_model, t, greedy(6)) for t in turns]
    assert short.choices[0].tokens == alone(tiny_model, new, greedy(4))


def test_auto_pools_the_cells_for_long_requests_that_share_a_prefix(tiny_model):
    """The same lengths, but the four prompts share a 260-token document: one pool computes and holds it once."""
    document = private_histories(tiny_model.n_vocab, 1, 260, seed=21)[0]
    prompts = [document + q[1:] for q in private_histories(tiny_model.n_vocab, 4, 21, seed=22)]
    gate = StepGate()
    with engine(tiny_model, gate, n_ctx=1024, n_seq_max=4) as eng:
        streams = [eng.submit(Request(p, greedy(6))) for p in prompts]
        gate.open()
        answers = [s.result(WAIT_S).choices[0].tokens for s in streams]
        stats = eng.stats()
    assert (stats.kv_layout, stats.relayouts) == ("unified", 1)
    assert stats.prefilled_tokens < sum(len(p) for p in prompts) - 2 * len(document)  # the document once or so
    assert answers == [alone(tiny_model, p, greedy(6)) for p in prompts]


def test_roomier_layout_keeps_concurrency_within_half_of_one_pools():
    """The choice itself: fewer streams only while they run at least half as many requests as one pool holds."""
    config = EngineConfig(n_ctx=4096, n_seq_max=16)  # split: 16 streams of 256
    long = Request(list(range(1, 601)), greedy(8))  # 608 cells: streams of 768, five of them
    privates = [Request([2] + list(range(1000 + 700 * i, 1000 + 700 * i + 599)), greedy(8)) for i in range(5)]
    assert _roomier(long, privates, config) == Layout(shared=False, slots=5)  # six fit one pool, five streams
    shorts = [Request([3, 4 + i] + [5] * 48, greedy(8)) for i in range(15)]  # 16 fit one pool: 5 < 16 / 2
    assert _roomier(long, shorts, config) == Layout(shared=True, slots=16)
    sharing = [Request(list(range(1, 401)) + [9] * 200, greedy(8))]  # starts with 400 of long's 600 tokens
    assert _roomier(long, sharing, config) == Layout(shared=True, slots=16)
    alone_long = Request(list(range(1, 1801)), greedy(8))  # 1,808 cells: two streams of 2,048
    assert _roomier(alone_long, [], config) == Layout(shared=False, slots=2)
    longer = Request(list(range(1, 2101)), greedy(8))  # more than half the pool: no two streams hold it
    assert _roomier(longer, [], config) == Layout(shared=True, slots=16)


def test_the_roomier_layout_is_chosen_for_the_burst_not_its_first_request(tiny_model):
    """Agents that start together reach the engine over some tens of milliseconds. The first request longer than
    a slot, alone in the queue, is not yet given a layout (on its own it would get fewer, longer streams); the
    choice waits until ``n_seq_max - 1`` requests wait behind it, one of them shares its document (one pool,
    whatever else arrives), or it has waited SETTLE_S: four prompts sharing a document then get one pool, and a
    lone one, once settled, its streams. A private prompt behind it settles nothing."""
    from kvrt.runtime.layout_policy import SETTLE_S, LayoutPolicy

    document = private_histories(tiny_model.n_vocab, 1, 260, seed=21)[0]
    head, *others = [Request(document + q[1:], greedy(6)) for q in private_histories(tiny_model.n_vocab, 4, 21)]
    gate = StepGate()  # nothing runs: the policy is asked directly, as the worker asks it
    with engine(tiny_model, gate, n_ctx=1024, n_seq_max=4) as eng:
        config, cache = eng.config, eng.cache
        alone_now = LayoutPolicy()
        assert not alone_now.admits(head, cache, config, running=False, waited_s=0.01)
        assert alone_now.switch_to is None and alone_now.recheck_in == pytest.approx(SETTLE_S - 0.01)
        burst = LayoutPolicy()
        assert not burst.admits(head, cache, config, running=False, waiting=lambda: others, waited_s=0.01)
        assert (burst.switch_to, burst.recheck_in) == (Layout(shared=True, slots=4), None)
        one_sharing = LayoutPolicy()
        assert not one_sharing.admits(head, cache, config, running=False, waiting=lambda: others[:1], waited_s=0.01)
        assert (one_sharing.switch_to, one_sharing.recheck_in) == (Layout(shared=True, slots=4), None)
        private = Request(private_histories(tiny_model.n_vocab, 1, 280, seed=25)[0], greedy(6))
        one_private = LayoutPolicy()
        assert not one_private.admits(head, cache, config, running=False, waiting=lambda: [private], waited_s=0.01)
        assert one_private.switch_to is None and one_private.recheck_in == pytest.approx(SETTLE_S - 0.01)
        settled = LayoutPolicy()
        assert not settled.admits(head, cache, config, running=False, waited_s=SETTLE_S)
        assert (settled.switch_to, settled.recheck_in) == (Layout(shared=False, slots=2), None)


def test_a_roomier_context_chooses_again_for_the_next_burst(tiny_model):
    """Four prompts longer than a slot sharing a document get one pool; four private histories after them, with
    nothing running and nothing of theirs cached, get two longer streams instead (in the pool each would attend
    over all of them); four sharing prompts after those get the pool again. Every answer equals the request alone."""
    document = private_histories(tiny_model.n_vocab, 1, 260, seed=21)[0]
    sharing = [[document + q[1:] for q in private_histories(tiny_model.n_vocab, 4, 21, seed=s)] for s in (22, 23)]
    histories = private_histories(tiny_model.n_vocab, 4, 280, seed=24)
    gate = HoldGate()
    layouts, answers = [], []
    with engine(tiny_model, gate, n_ctx=1024, n_seq_max=4) as eng:
        for burst in (sharing[0], histories, sharing[1]):
            gate.hold()
            streams = [eng.submit(Request(p, greedy(6))) for p in burst]  # all queued before the worker looks
            gate.open()
            answers += [s.result(WAIT_S).choices[0].tokens for s in streams]
            stats = eng.stats()
            layouts.append((stats.kv_layout, len(stats.slots), stats.relayouts))
            assert_mirror_matches_llama_cpp(eng)
    assert layouts == [("unified", 4, 1), ("split", 2, 2), ("unified", 4, 3)]
    assert answers == [alone(tiny_model, p, greedy(6)) for p in sharing[0] + histories + sharing[1]]
