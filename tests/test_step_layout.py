"""A split-layout step's prompt chunks evened (kvrt.runtime.step_layout.even_chunks), against llama.cpp's split rule.

Reference: :func:`kvrt.engine.micro_batches.split_per_stream`, checked token by token against a port of llama.cpp's
``split_equal`` in test_micro_batches.py; the engine's outputs are compared with a fresh context's (the tiny F32
model is exact under batching).
"""

from __future__ import annotations

import random

import pytest

from kvrt.engine.decode_step import Feed, takes
from kvrt.engine.micro_batches import read_bytes, split_per_stream
from kvrt.runtime.requests import Request
from kvrt.runtime.step_layout import even_chunks, fill_gaps
from kvrt.runtime.step_trace import StepTrace, read_trace
from test_batching import WAIT_S, alone, engine, greedy
from test_engine_layouts import HoldGate, private_histories

WEIGHTS = 15 << 30  # the Qwen2.5-7B shape in F16: what a micro-batch reads besides the K/V
CELL = 57_344  # its K/V a cell


def cost(held: int):
    return lambda shape: read_bytes(shape, 512, lambda seq: held, WEIGHTS, CELL)


def step_feeds(decoding: list[int], prompting: list[int], left: int) -> list[Feed]:
    return ([Feed(seq, 100, (7,)) for seq in decoding]
            + [Feed(seq, 0, tuple(range(left)), done=0) for seq in prompting])


def split_of(feeds: list[Feed], chunk: int, budget: int) -> list[dict[int, int]]:
    return split_per_stream(sorted((f.seq, t) for f, t in takes(feeds, budget=budget, chunk=chunk)), 512)


def micro_batches(feeds: list[Feed], pads: list[Feed], decoding: int, budget: int) -> list[dict[int, int]]:
    chosen = takes(feeds[:decoding] + pads + feeds[decoding:], budget=budget, chunk=512)
    return split_per_stream(sorted((f.seq, t) for f, t in chosen), 512)


def test_prefilling_slots_left_without_budget_get_a_prompt_token_so_the_step_is_one_run():
    """Sixteen decode rows in the even slots, sixteen prompts in the odd ones of which the budget reaches four:
    the waiting ones break the run of slots, so llama.cpp makes a micro-batch of every piece; a prompt token each
    (taken from the last chunk) makes one run, then the four chunks."""
    feeds = step_feeds(list(range(0, 32, 2)), list(range(1, 32, 2)), 4096)
    plain = micro_batches(feeds, [], 16, 2048)
    order, filled, pads = fill_gaps(feeds, 16, budget=2048, chunk=512, padding=lambda seqs: [], cost=cost(2048))
    gap_filled = micro_batches(filled, pads, 16, 2048)
    assert (len(plain), len(gap_filled), pads) == (16, 5, [])
    assert order[:16] == list(range(16))  # the decode rows first: never delayed
    landed = dict(sorted((f.seq, t) for f, t in takes(filled, budget=2048, chunk=512)))
    assert all(landed[seq] == 1 for seq in range(9, 31, 2)) and sum(landed.values()) == 2048  # a token each
    cut = [(f.seq, f.done, f.left) for i, f in enumerate(filled) if f is not feeds[order[i]]]
    assert cut == [(seq, 0, 1) for seq in range(9, 31, 2)]  # slot 31 is past the run; the rest as given


def test_gaps_are_left_when_filling_them_reads_more_a_token():
    """Four prompt chunks in slots far apart, no decode rows: each is a micro-batch of its own either way, and a
    token for every waiting slot between them only adds a pass: the layout stays as given."""
    feeds = step_feeds([], [0, 10, 20, 30, 5, 15, 25], 4096)
    order, filled, pads = fill_gaps(feeds, 0, budget=2048, chunk=512, padding=lambda seqs: [], cost=cost(1024))
    assert (order, filled, pads) == (list(range(7)), feeds, [])


def test_a_decode_row_that_cuts_the_last_chunk_short_evens_all_of_them():
    """The H100 trace's case: one decode row and four 512-token chunks in 2,048 tokens (the last cut to 511)."""
    feeds = step_feeds([5], [6, 7, 8, 9], 4096)
    assert len(split_of(feeds, 512, 2048)) == 6  # 1 + 3 x 128 + 127 + 1 of each: six weight passes
    chunk, budget = even_chunks(feeds, 1, budget=2048, chunk=512, ubatch=512, cost=cost(4096))
    assert (chunk, budget) == (511, 2045)
    evened = split_of(feeds, chunk, budget)
    assert len(evened) == 5 and sum(sum(part.values()) for part in evened) == 2045


def test_evening_frees_no_budget_for_a_chunk_more():
    """The same step with more prompts waiting behind the four (a CPU replay of the H100 private run: 28 of them):
    the three tokens the cap frees must not go to a fifth chunk, which would cost a micro-batch of its own."""
    feeds = step_feeds([4], [7, 8, 9, 10] + list(range(11, 32)), 4096)
    chunk, budget = even_chunks(feeds, 1, budget=2048, chunk=512, ubatch=512, cost=cost(4096))
    evened = split_of(feeds, chunk, budget)
    assert len(split_of(feeds, 512, 2048)) == 6 and len(evened) == 5
    assert [part for part in evened if 11 in part] == []  # no chunk of a fifth prompt


def test_a_prompt_ending_inside_its_chunk_sets_the_length_of_all_of_them():
    """A replayed step: chunks of 510 (the end of slot 0's prompt), 512 and 512 in slots 0-2, a decode row in slot
    4, a chunk in slot 31: the run of slots 0-2 splits 3 x 170 then 2 x 2 (six passes); capped at 510, five."""
    feeds = [Feed(4, 100, (7,)), Feed(0, 0, tuple(range(4096)), done=3586)] + step_feeds([], [1, 2, 31], 4096)
    assert len(split_of(feeds, 512, 2048)) == 6
    chunk, budget = even_chunks(feeds, 1, budget=2048, chunk=512, ubatch=512, cost=cost(4096))
    assert (chunk, budget) == (510, 2041) and len(split_of(feeds, chunk, budget)) == 5


def test_three_chunks_in_consecutive_slots_no_longer_leave_a_micro_batch_of_slivers():
    """A prompt-only step of four 512-token chunks in slots 16 and 20-22 (decoding slots between them): llama.cpp
    gives each of the three consecutive ones 170 tokens a micro-batch, so 512 leaves a micro-batch of 2 each (five
    for 2,048 tokens). Capped at 510 they split into three (four for 2,040); the third left to the next step, the
    rest make three for 1,536. The model finds those two equal to a byte: either beats the five."""
    feeds = step_feeds([], [16, 20, 21, 22], 4096)
    assert len(split_of(feeds, 512, 2048)) == 5
    assert len(split_of(feeds, 510, 2040)) == 4 and len(split_of(feeds, 512, 1536)) == 3
    chunk, budget = even_chunks(feeds, 0, budget=2048, chunk=512, ubatch=512, cost=cost(2048))
    assert (chunk, budget) in ((510, 2040), (512, 1536))


def test_a_lone_chunk_is_never_left_out():
    """One prompt chunk and no decode rows: leaving it to the next step would leave the step empty."""
    feeds = step_feeds([], [3], 4096)
    assert even_chunks(feeds, 0, budget=2048, chunk=512, ubatch=512, cost=cost(0)) == (512, 2048)


def test_a_chunk_cut_to_a_sliver_waits_for_the_next_step():
    feeds = step_feeds([], [0, 1, 2], 4096)  # 512 + 512 + 8: 3 x 8, then 2 x 256, 2 x 248
    assert len(split_of(feeds, 512, 1032)) == 3 and len(split_of(feeds, 8, 1032)) == 1
    assert even_chunks(feeds, 0, budget=1032, chunk=512, ubatch=512, cost=cost(1024)) == (512, 1024)  # 2 x 512 in two


def test_whole_chunks_and_single_chunks_are_left_as_they_are():
    short = step_feeds([0], [1, 2, 3], 100)  # every prompt ends inside the budget
    assert even_chunks(short, 1, budget=2048, chunk=512, ubatch=512, cost=cost(0)) == (512, 2048)
    one = step_feeds([0, 1], [2], 4096)  # one prompt chunk: nothing to even it with
    assert even_chunks(one, 2, budget=64, chunk=512, ubatch=512, cost=cost(0)) == (512, 64)


def test_next_turns_of_all_agents_take_four_micro_batches_a_full_step():
    """32 agents' next turns of 129 new tokens in a 2,048-token step: 16 chunks of 128 in consecutive slots split
    into four micro-batches of 16 x 32 (every token a request's); 15 of 129 and one of 113 would take five, and 15
    of 129 alone four for fewer tokens."""
    feeds = step_feeds([], [*range(8, 32), *range(8)], 129)
    assert len(split_of(feeds, 512, 2048)) == 5
    chunk, budget = even_chunks(feeds, 0, budget=2048, chunk=512, ubatch=512, cost=cost(4300))
    assert (chunk, budget) == (128, 2048)
    assert split_of(feeds, chunk, budget) == [dict.fromkeys(range(8, 24), 32)] * 4


def runs(slots: list[int]) -> int:
    """How many runs of consecutive numbers ``slots`` (sorted) make."""
    return sum(1 for i, slot in enumerate(slots) if i == 0 or slot != slots[i - 1] + 1)


def test_next_turns_arriving_in_any_order_are_prefilled_in_runs_of_slots(tiny_model, tmp_path):
    """Eight agents, then their next turns (18 tokens to prefill each) submitted in a shuffled order while the
    engine is held, 48 tokens a step: each step's prompt chunks go to one run of consecutive slots, not to the first
    requests to arrive, nor past the last slot to the first ones (llama.cpp's split layout computes a micro-batch a
    run), and no step but the last leaves tokens of its budget unused for that; every output equals a fresh
    context's."""
    agents, gen = 8, 4
    histories = private_histories(tiny_model.n_vocab, agents, 40)
    rng = random.Random(3)
    news = [[rng.randrange(3, tiny_model.n_vocab) for _ in range(17)] for _ in range(agents)]
    gate = HoldGate()
    trace = StepTrace(tmp_path / "steps.jsonl")
    with engine(tiny_model, gate, n_ctx=agents * 256, n_seq_max=agents, n_batch=48, prefill_chunk=48,
                kv_layout="split") as eng:
        eng.trace = trace
        replies = [s.result(WAIT_S).choices[0].tokens
                   for s in [eng.submit(Request(h, greedy(gen))) for h in histories]]
        first_turn = len(read_trace(trace.path))
        turns = [h + r + n for h, r, n in zip(histories, replies, news)]
        order = rng.sample(range(agents), agents)
        gate.hold()
        streams = dict(zip(order, [eng.submit(Request(turns[i], greedy(gen))) for i in order]))
        gate.open()
        outputs = [streams[i].result(WAIT_S).choices[0].tokens for i in range(agents)]
    prompt_steps = [step for step in read_trace(trace.path)[first_turn:] if step.prompt_chunks]
    assert sum(step.prompt_tokens for step in prompt_steps) == sum(len(n) + 1 for n in news)  # own history kept
    assert len(prompt_steps) >= 3 and all(runs([slot for slot, _ in step.shape]) == 1 for step in prompt_steps)
    assert all(step.tokens == 48 for step in prompt_steps[:-1])
    assert outputs == [alone(tiny_model, t, greedy(gen)) for t in turns]


def test_no_prompt_waits_more_than_a_pass_for_its_next_chunk(tiny_model, tmp_path):
    """Eight 100-token prompts at once, three chunks of 16 a step: the round robin by slot never wraps past the
    last slot, and never skips the last slots to avoid it either: every prompt gets a chunk within any three
    consecutive steps until it is in (a pass over eight slots, three a step)."""
    prompts = private_histories(tiny_model.n_vocab, 8, 100, seed=5)
    gate = HoldGate()
    trace = StepTrace(tmp_path / "steps.jsonl")
    with engine(tiny_model, gate, n_ctx=8 * 256, n_seq_max=8, n_batch=48, prefill_chunk=16,
                kv_layout="split") as eng:
        eng.trace = trace
        gate.hold()
        streams = [eng.submit(Request(p, greedy(2))) for p in prompts]
        gate.open()
        outputs = [s.result(WAIT_S).choices[0].tokens for s in streams]
    fed = [{slot for slot, tokens in step.shape if tokens > 1}  # chunks, not decode rows or gap tokens
           for step in read_trace(trace.path) if step.prompt_chunks]
    done = {slot: max(i for i, slots in enumerate(fed) if slot in slots) for slot in range(8)}  # its last chunk
    for slot in range(8):
        waits = [i for i in range(done[slot]) if slot not in fed[i]]
        longest = max((len(run) for run in _runs_of(waits)), default=0)
        assert longest <= 2, f"slot {slot} went {longest} prompt steps without a chunk"
    assert outputs == [alone(tiny_model, p, greedy(2)) for p in prompts]


def _runs_of(numbers: list[int]) -> list[list[int]]:
    """``numbers`` (ascending) cut into runs of consecutive ones."""
    out: list[list[int]] = []
    for n in numbers:
        if out and n == out[-1][-1] + 1:
            out[-1].append(n)
        else:
            out.append([n])
    return out


def short_beside_long(model, max_tokens: tuple[int, ...], **config) -> None:
    """A short prompt beside three long ones in consecutive slots of a split engine, 48 tokens a step in chunks of
    16, ``max_tokens`` each: every output equals a fresh context's, and llama.cpp's memory holds what the engine's
    mirror says."""
    prompts = [model.tokenize("a short one")] + [model.tokenize(f"prompt {i} " + "goes on and on " * 12)
                                                  for i in range(3)]
    with engine(model, n_seq_max=4, n_batch=48, prefill_chunk=16, kv_layout="split", **config) as eng:
        streams = [eng.submit(Request(p, greedy(n))) for p, n in zip(prompts, max_tokens)]
        outputs = [s.result(60.0).choices[0].tokens for s in streams]
        for slot in range(4):
            assert eng.ctx.seq_pos_max(slot) == eng.cache.held(slot) - 1
    assert outputs == [alone(model, p, greedy(n)) for p, n in zip(prompts, max_tokens)]


@pytest.mark.parametrize("even", [True, False])
def test_evened_steps_give_every_request_a_fresh_contexts_tokens(tiny_model, monkeypatch, even):
    """A short prompt beside three long ones in consecutive slots, 48 tokens a step in chunks of 16: the short one's
    decode row cuts the last chunk short, so steps are evened (seen through a wrapper of even_chunks); every output
    equals a fresh context's and llama.cpp's memory holds what the engine's mirror says. ``even_chunks=False``: the
    layout is never asked for."""
    from kvrt.runtime import step_layout

    chosen: list[tuple[tuple[int, int], tuple[int, int]]] = []

    def watched(feeds, decoding, *, budget, chunk, ubatch, cost):
        choice = even_chunks(feeds, decoding, budget=budget, chunk=chunk, ubatch=ubatch, cost=cost)
        chosen.append(((chunk, budget), choice))
        return choice

    monkeypatch.setattr(step_layout, "even_chunks", watched)
    short_beside_long(tiny_model, (40, 6, 6, 6), even_chunks=even)
    assert any(given != choice for given, choice in chosen) if even else not chosen  # some steps were evened


def test_steps_with_gap_tokens_give_every_request_a_fresh_contexts_tokens(tiny_model, monkeypatch):
    """Short prompts in the even slots (decoding soon) and long ones in the odd slots, 32 tokens a step in chunks of
    16: beside the four decode rows the budget takes the chunks of the last two prompting slots when the round
    robin is there, leaving the first two between decode rows, which get a prompt token each (seen through a
    wrapper of fill_gaps); every output equals a fresh context's and llama.cpp's memory holds the engine's mirror."""
    from kvrt.runtime import step_layout

    gap_tokens: list[int] = []

    def watched(feeds, decoding, **kw):
        order, filled, pads = fill_gaps(feeds, decoding, **kw)
        gap_tokens.append(sum(f is not feeds[i] for i, f in zip(order, filled)))
        return order, filled, pads

    monkeypatch.setattr(step_layout, "fill_gaps", watched)
    prompts = [tiny_model.tokenize(f"short {i}") if i % 2 == 0 else
               tiny_model.tokenize(f"prompt {i} " + "goes on and on " * 10) for i in range(8)]
    with engine(tiny_model, n_ctx=2048, n_seq_max=8, n_batch=32, prefill_chunk=16, kv_layout="split",
                decode_wait_s=0) as eng:  # decode rows in every step: the steps with gaps between them
        streams = [eng.submit(Request(p, greedy(12))) for p in prompts]
        outputs = [s.result(60.0).choices[0].tokens for s in streams]
        for slot in range(8):
            assert eng.ctx.seq_pos_max(slot) == eng.cache.held(slot) - 1
    assert max(gap_tokens) > 0
    assert outputs == [alone(tiny_model, p, greedy(12)) for p in prompts]


@pytest.mark.parametrize("wait_s", [0.0, 1000.0])
def test_decode_rows_sit_out_steps_that_prompts_fill_for_at_most_the_wait(tiny_model, monkeypatch, wait_s):
    """One short prompt (decoding after a step or two) beside three long ones that fill every step's 48 tokens in
    chunks of 16: with ``decode_wait_s=0`` every step carries the decode row; with a wait longer than the run, only
    the first step with a decoder does until the long prompts stop filling steps. Every output equals a fresh
    context's either way, and llama.cpp's memory holds what the engine's mirror says."""
    from kvrt.runtime import step_layout

    steps: list[tuple[int, int, int]] = []  # (decoders waiting, decode rows carried, prompt tokens the step could take)
    fill = step_layout.BatchFiller.fill

    def watched(self, running, turn, ctx, cache, **kw):
        step = fill(self, running, turn, ctx, cache, **kw)
        decoders = sum(c.pending is not None for live in running for c in live.choices)
        prompt_work = sum(min(len(live.prompt) - live.prefilled, self.chunk) for live in running if live.prefilling)
        steps.append((decoders, sum(r.choice is not None for r in step.rows), prompt_work))
        return step

    monkeypatch.setattr(step_layout.BatchFiller, "fill", watched)
    short_beside_long(tiny_model, (12, 4, 4, 4), decode_wait_s=wait_s)
    full = [(decoders, rows) for decoders, rows, work in steps if decoders and work >= 48]
    assert len(full) >= 3  # the long prompts kept steps full while the short one decoded
    if wait_s:
        assert [rows for _, rows in full] == [1] + [0] * (len(full) - 1)
    else:
        assert all(rows == decoders for decoders, rows in full)


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), True, "0.5"])
def test_a_decode_wait_that_is_not_a_finite_number_of_seconds_is_refused_by_name(bad):
    from kvrt.runtime.admission import EngineConfig
    from kvrt.runtime.requests import EngineError

    with pytest.raises(EngineError, match="decode_wait_s must be a finite number >= 0"):
        EngineConfig(decode_wait_s=bad)
