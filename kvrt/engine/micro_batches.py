"""How many micro-batches llama.cpp splits one ``llama_decode`` batch into, counted without calling it.

Every micro-batch reads all of the model's weights once, so on a GPU a step's cost grows
with their number more than with its tokens: a decode step of 32 sequences is one
micro-batch, the same step with one sequence's 64-token prompt chunk in it is two.
llama.cpp (``llama_kv_cache::init_batch``, ``llama_batch_allocr::split_simple`` and
``split_equal(sequential=true)`` in ``src/llama-batch.cpp``) splits a batch

- with one KV stream (the unified layout): into runs of at most ``n_ubatch`` tokens, in order;
- with a stream per sequence (the split layout): each micro-batch takes a run of consecutive
  sequence ids (the rows' first unused token of each, in batch order, a sequence joining only
  when its id is the last one's plus one) and the same number of tokens from each of them,
  as many as the run's shortest remainder allows within ``n_ubatch``.

So in the split layout a gap in the sequence ids, or prompt chunks of different lengths,
cost micro-batches of their own. :func:`count_micro_batches` replays that rule on the
rows' sequence ids and token counts (what :func:`kvrt.engine.decode_step.fill` laid out);
it is a model of llama.cpp's code, for the engine's counters and step trace, not an input
to any decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def count_micro_batches(rows: Sequence[tuple[int, int]], n_ubatch: int, *, per_stream: bool) -> int:
    """Micro-batches of a batch whose rows are ``(sequence id, tokens)`` in batch order (a sequence at most once),
    split as llama.cpp splits it with ``n_ubatch`` (``per_stream``: a KV stream per sequence)."""
    if not per_stream:
        return math.ceil(sum(tokens for _, tokens in rows) / n_ubatch)
    return len(split_per_stream(rows, n_ubatch))


def split_per_stream(rows: Sequence[tuple[int, int]], n_ubatch: int) -> list[dict[int, int]]:
    """The micro-batches of a batch with a KV stream per sequence (rows as :func:`count_micro_batches` takes
    them), each as sequence id -> its tokens in that micro-batch, in llama.cpp's order."""
    left = {seq: tokens for seq, tokens in rows if tokens > 0}
    order = [seq for seq, tokens in rows if tokens > 0]
    out: list[dict[int, int]] = []
    while left:
        run: list[int] = []
        for seq in order:  # llama.cpp walks the rows; a sequence joins when its id follows the last one's
            if seq in left and (not run or seq == run[-1] + 1) and len(run) <= n_ubatch:  # (its bound, to the letter)
                run.append(seq)
        take = max(1, min(min(left[seq] for seq in run), n_ubatch // len(run)))
        out.append(dict.fromkeys(run, take))
        for seq in run:
            left[seq] -= take
            if not left[seq]:
                del left[seq]
        order = [seq for seq in order if seq in left]
    return out


def read_bytes(rows: Sequence[tuple[int, int]], n_ubatch: int, held: Callable[[int], int], weight_bytes: int,
               cell_bytes: int) -> int:
    """What a batch of ``rows`` (as :func:`split_per_stream` takes them) reads from memory with a KV stream per
    sequence, as a GPU decode pays for it: every micro-batch reads all ``weight_bytes``, and each of its sequences
    the K/V (``cell_bytes`` a cell) of as many cells as the longest of them will hold (``held(seq)`` before the
    batch, plus its tokens), llama.cpp giving a micro-batch's streams one common length. A model for comparing two
    layouts of the same step, not a prediction of its time."""
    return sum(weight_bytes + len(part) * max(held(seq) + n for seq, n in part.items()) * cell_bytes
               for part in split_per_stream(rows, n_ubatch))
