"""Text streamed piece by piece, by generate() and by the per-agent scheduler: the pieces are the answer.

Reference: the same generation without streaming (its Completion.text). A stop string is
chosen from the unstopped output itself, so it certainly occurs; no piece may show any of it.
"""

from __future__ import annotations

import pytest

from kvrt.accounting.estimate import ModelShape, context_estimate
from kvrt.accounting.ledger import VramLedger
from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams, generate, held_back
from kvrt.serve.scheduler import Scheduler
from test_scheduler import charge_estimates

PROMPT = "The quick brown fox"
N_TOKENS = 24


def complete(model, params: GenerationParams, pieces: list[str] | None = None):
    with Context(model, n_ctx=256, n_threads=1) as ctx:
        return generate(ctx, PROMPT, params, on_text=None if pieces is None else pieces.append)


@pytest.fixture(scope="module")
def unstopped(tiny_model):
    return complete(tiny_model, GenerationParams(max_tokens=N_TOKENS))


def test_generate_streams_pieces_that_join_to_the_completion(tiny_model, unstopped):
    pieces: list[str] = []
    done = complete(tiny_model, GenerationParams(max_tokens=N_TOKENS), pieces)
    assert done.text == unstopped.text and "".join(pieces) == done.text
    assert len(pieces) > 1 and all(pieces)  # streamed as it went, never an empty piece


def test_no_piece_shows_any_part_of_a_stop_string(tiny_model, unstopped):
    text = unstopped.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3
    pieces: list[str] = []
    done = complete(tiny_model, GenerationParams(max_tokens=N_TOKENS, stop=(stop,)), pieces)
    assert done.finish_reason == "stop" and done.text == text[:text.find(stop)]
    assert "".join(pieces) == done.text


@pytest.mark.parametrize("text, stops, held", [
    ("abc", ("cde",), 1), ("abcd", ("cde",), 2), ("abc", ("xyz",), 0), ("ab", ("b", "abx"), 2), ("", ("ab",), 0),
])
def test_held_back_is_the_longest_suffix_that_starts_a_stop(text, stops, held):
    assert held_back(text, stops) == held


@pytest.fixture(autouse=True)
def _estimated_charges(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's ledger below is sized from the header's estimates: it must charge those on a GPU too."""
    charge_estimates(monkeypatch)


def _scheduler(tiny_model_path) -> Scheduler:
    shape = ModelShape.read(tiny_model_path)
    return Scheduler(VramLedger(shape.weight_bytes(on_gpu=False) + context_estimate(shape, 256).total_bytes),
                     n_threads=1)


def test_the_per_agent_scheduler_streams_while_it_generates(tiny_model_path, tiny_model, unstopped):
    pieces: list[str] = []
    with _scheduler(tiny_model_path) as sched:
        sched.register("a", tiny_model_path, n_ctx=256)
        result = sched.submit("a", PROMPT, N_TOKENS, on_text=pieces.append).result(timeout=120)
    assert result.text == unstopped.text and "".join(pieces) == result.text and len(pieces) > 1


def test_cancel_stops_a_running_turn_and_the_agent_stays_its_transcript(tiny_model_path, tiny_model, unstopped):
    counts: list[int] = []
    with _scheduler(tiny_model_path) as sched:
        sched.register("a", tiny_model_path, n_ctx=256)
        result = sched.submit("a", PROMPT, N_TOKENS, on_text=lambda piece: counts.append(sched.cancel("a"))
                              ).result(timeout=120)
        history = sched.transcript("a")
        follow_up = sched.decode("a", " and then", 8)
    assert counts[0] == 1  # the running turn
    assert result.finish_reason == "cancelled" and 0 < len(result.tokens) < N_TOKENS
    assert unstopped.text.startswith(result.text) and result.tokens == unstopped.tokens[:len(result.tokens)]
    assert history == tiny_model.tokenize(PROMPT) + result.tokens
    with Context(tiny_model, n_ctx=256, n_threads=1) as ctx:  # reference: the transcript from scratch
        reference = generate(ctx, history + tiny_model.tokenize(" and then", add_special=False),
                             GenerationParams(max_tokens=8))
    assert follow_up.tokens == reference.tokens


def test_a_running_turn_stops_at_its_deadline(tiny_model_path):
    import time

    with _scheduler(tiny_model_path) as sched:
        sched.register("a", tiny_model_path, n_ctx=256)
        result = sched.submit("a", PROMPT, N_TOKENS, deadline=time.monotonic() + 0.2,
                              on_text=lambda piece: time.sleep(0.1)).result(timeout=120)
    assert result.finish_reason == "deadline" and len(result.tokens) < N_TOKENS


def test_ignore_eos_keeps_an_end_of_generation_token_as_output(tiny_model):
    from kvrt.engine.generation import SequenceStream

    eos = 2  # the test model's end-of-sequence id (testmodels.write_model)
    assert tiny_model.is_eog(eos)
    ending, going_on = (SequenceStream(tiny_model, GenerationParams(max_tokens=3, ignore_eos=flag))
                        for flag in (False, True))
    assert ending.accept(eos) and ending.finish_reason == "eog" and ending.tokens == []
    assert [going_on.accept(t) for t in (eos, 5, eos)] == [False, False, True]
    assert going_on.finish_reason == "length" and going_on.tokens == [eos, 5, eos]
