"""Backend sampling (EngineConfig.backend_sampling, Context.sample_on_device): greedy picks made in llama.cpp's graph.

References: the same engine with backend sampling off (host argmax over copied logits), and NumPy's argmax of a
row llama.cpp did copy. The tiny F32 model with flash attention off is exact under batching, so tokens are
compared for equality.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.context_params import ContextParams
from kvrt.engine.generation import GenerationParams
from kvrt.engine.sampling import SamplingParams
from kvrt.errors import DecodeError, KvrtError
from kvrt.runtime.requests import Request
from test_batching import engine, greedy

WAIT_S = 60.0


def sampled(temperature: float, max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(temperature=temperature, seed=7))


def decode_rows(ctx: Context, batch: Batch, prompts: list[list[int]]) -> list[int]:
    """One batch with each prompt in its own sequence, logits on every last token; their rows."""
    batch.clear()
    rows = [batch.add_sequence(p, 0, seq) for seq, p in enumerate(prompts)]
    ctx.decode(batch)
    return rows


def test_device_picks_equal_the_host_argmax_and_their_logits_are_refused(tiny_model):
    prompts = [tiny_model.tokenize(f"sequence {i} says something") for i in range(3)]
    params = ContextParams(n_ctx=768, n_batch=128, n_ubatch=128, n_seq_max=3, flash_attn="off", backend_sampling=True)
    with Context(tiny_model, params) as ctx, Batch(128) as batch:
        host = decode_rows(ctx, batch, prompts)
        expected = [int(ctx.logits(row).argmax()) for row in host]
        assert ctx.device_rows == frozenset()
        ctx.clear()
        ctx.sample_on_device(0)
        ctx.sample_on_device(2)
        rows = decode_rows(ctx, batch, prompts)
        assert ctx.sampled_on_device == {0, 2} and ctx.device_rows == {rows[0], rows[2]}
        assert ctx.argmax(rows) == expected
        for row in (rows[0], rows[2], -1):  # -1 may be a device row: refused while any row is one
            assert not ctx.has_logits(row)
            with pytest.raises(DecodeError, match="sampled on the device"):
                ctx.logits(row)
        assert int(ctx.logits(rows[1]).argmax()) == expected[1]  # a host row keeps its logits
        ctx.sample_on_device(0, False)
        ctx.sample_on_device(2, False)
        ctx.clear()
        rows = decode_rows(ctx, batch, prompts)
        assert ctx.device_rows == frozenset() and [int(ctx.logits(r).argmax()) for r in rows] == expected


def test_a_context_without_backend_sampling_refuses_it_and_outputs_past_the_cap_are_refused(tiny_model):
    with Context(tiny_model, n_ctx=512, n_seq_max=2) as ctx:
        with pytest.raises(KvrtError, match="backend_sampling=True"):
            ctx.sample_on_device(0)
    params = ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=2, flash_attn="off", backend_sampling=True)
    with Context(tiny_model, params) as ctx, Batch(64) as batch:
        for pos, token in enumerate(tiny_model.tokenize("three outputs")[:3]):
            batch.add(token, pos, 0, logits=True)
        with pytest.raises(DecodeError, match="at most n_seq_max=2"):  # llama.cpp would abort the process
            ctx.decode(batch)
        assert ctx.seq_len(0) == 0
        with pytest.raises(KvrtError, match="outside"):
            ctx.sample_on_device(2)


def run(model, backend: bool) -> tuple[list[list[int]], list[list[int]], object]:
    """Three agents, two turns each, all greedy; then a greedy request with logprobs and a sampled one beside a
    greedy one (their slots turn to host sampling and back). Outputs of the turns, the mixed step's, stats."""
    with engine(model, n_seq_max=4, kv_layout="split", backend_sampling=backend) as eng:
        histories = [model.tokenize(f"agent {name} has a history of its own") for name in "abc"]
        turns = []
        for _ in range(2):
            streams = [eng.submit(Request(h, greedy(12))) for h in histories]
            outputs = [list(s.result(WAIT_S).choices[0].tokens) for s in streams]
            turns.append(outputs)
            histories = [h + out + model.tokenize(" then", add_special=False) for h, out in zip(histories, outputs)]
        mixed = [eng.submit(Request(histories[0], greedy(6), logprobs=2)),
                 eng.submit(Request(histories[1], sampled(0.8, 6))),
                 eng.submit(Request(histories[2], greedy(6)))]
        results = [s.result(WAIT_S) for s in mixed]
        assert all(len(r.choices[0].logprobs) == 6 for r in results[:1])
        again = eng.submit(Request(histories[0], greedy(6))).result(WAIT_S)
        return turns, [list(r.choices[0].tokens) for r in results] + [list(again.choices[0].tokens)], eng.stats()


def test_an_engine_sampling_on_the_device_gives_the_host_engines_tokens(tiny_model):
    device_turns, device_mixed, device = run(tiny_model, backend=True)
    host_turns, host_mixed, host = run(tiny_model, backend=False)
    assert device_turns == host_turns and device_mixed == host_mixed
    assert host.sampled_on_device == host.sampler_switches == 0
    # every plain greedy token (the turns', the greedy mixed one's, the last one's), none of the others
    assert device.sampled_on_device == 3 * 2 * 12 + 6 + 6
    # three slots turn to the device at the first step; the logprobs and sampled requests' slots to the host;
    # the last request's slot back to the device
    assert device.sampler_switches == 3 + 2 + 1
    assert np.array_equal(device_mixed[0], device_mixed[3])  # greedy, with or without logprobs: the same tokens
