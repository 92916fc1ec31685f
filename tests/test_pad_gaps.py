"""Gap padding (EngineConfig.pad_gaps): idle slots between a step's sequences get a throwaway token in the split layout.

Reference: the same engine with padding off. The tiny F32 model with flash attention off is exact under batching,
so tokens are compared for equality; the admission order is fixed by a closed step gate while everything is
queued, so the steps (and their micro-batch counts) are the same on every run.
"""

from __future__ import annotations

from dataclasses import replace

from kvrt.engine.generation import GenerationParams
from kvrt.engine.sampling import SamplingParams
from kvrt.runtime.requests import Request
from test_batching import StepGate, engine

WAIT_S = 60.0


def greedy(max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))


def gapped_run(model, pad: bool) -> tuple[list[list[int]], list[int], object, object]:
    """Slots 0, 1, 2 start together; slot 1's request ends first, so slots 0 and 2 decode on with an idle cached
    slot between them. Then slot 1's conversation goes on, reusing its history. Returns the outputs, the follow-up's
    output, and the engine's stats after the first three and at the end."""
    prompts = [model.tokenize(f"conversation {name} starts with a line of its own") for name in ("a", "b", "c")]
    gate = StepGate()
    with engine(model, gate, n_seq_max=4, kv_layout="split", pad_gaps=pad) as eng:
        streams = [eng.submit(Request(p, greedy(n))) for p, n in zip(prompts, (24, 3, 24))]
        gate.open()
        outputs = [list(s.result(WAIT_S).choices[0].tokens) for s in streams]
        first = eng.stats()
        history = prompts[1] + outputs[1]
        follow = eng.submit(Request(history + model.tokenize(" and more", add_special=False), greedy(8)))
        more = list(follow.result(WAIT_S).choices[0].tokens)
        # llama.cpp's memory holds exactly what the mirror says: no pad left behind in any slot
        for slot in range(4):
            assert eng.ctx.seq_pos_max(slot) == eng.cache.held(slot) - 1
        return outputs, more, first, eng.stats()


def test_padding_keeps_every_token_and_every_history_and_saves_micro_batches(tiny_model):
    padded, padded_more, padded_first, padded_end = gapped_run(tiny_model, pad=True)
    plain, plain_more, plain_first, plain_end = gapped_run(tiny_model, pad=False)
    assert padded == plain and padded_more == plain_more
    assert padded_first.steps == plain_first.steps
    # slot 1 idle between slots 0 and 2 for the last ~20 steps: 2 micro-batches each unpadded, 1 padded
    assert padded_first.micro_batches <= plain_first.micro_batches - 15
    assert padded_end.reused_tokens == plain_end.reused_tokens > 0  # the follow-up found its history either way


def test_padding_fills_gaps_of_idle_slots_in_the_split_layout_only(tiny_model):
    prompts = [tiny_model.tokenize(f"request {i} of a few") for i in range(3)]
    for layout in ("unified", "split"):
        with engine(tiny_model, n_seq_max=4, kv_layout=layout) as eng:
            for p in prompts:  # one after the other: slots 0, 1, 2 cached
                eng.submit(Request(p, greedy(4))).result(WAIT_S)
            pads = eng.cache.padding([0, 2])
            if layout == "unified":
                assert pads == []
                continue
            (pad,) = pads
            assert (pad.seq, pad.pos, tuple(pad.tokens), pad.logits) == (1, eng.cache.held(1), (0,), False)
            assert eng.cache.padding([0, 1, 2]) == [] and eng.cache.padding([0]) == []
            assert [p.seq for p in eng.cache.padding([0, 3])] == [1, 2]


def test_a_step_whose_pad_llama_cpp_refuses_runs_again_without_pads(tiny_model, monkeypatch, caplog):
    """A pad at a position llama.cpp refuses (a mirror gone wrong) must not fail the step's requests."""
    plain, _, _, _ = gapped_run(tiny_model, pad=False)
    from kvrt.runtime.prefix_cache import PrefixCache

    padding = PrefixCache.padding

    def wrong(self, seqs):
        return [replace(pad, pos=pad.pos + 5) for pad in padding(self, seqs)]

    monkeypatch.setattr(PrefixCache, "padding", wrong)
    outputs, _, first, _ = gapped_run(tiny_model, pad=True)
    assert outputs == plain
    assert any("pads failed" in r.getMessage() for r in caplog.records)
