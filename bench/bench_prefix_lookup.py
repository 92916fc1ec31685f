"""Microbenchmark of admission's slot lookup: which of 32 slots shares the longest prefix with a prompt.

Run: ``pytest bench/bench_prefix_lookup.py --benchmark-enable`` (plain ``pytest`` runs each once
as a test). The slots hold the swarm's shape on issue 24's H200 preset: one shared 4,096-token
document and 600 tokens of each agent's own; the prompt is one agent's history and a new turn.
:meth:`kvrt.runtime.slot_tokens.SlotTokens.common_prefixes` (one comparison of the whole table,
what ``PrefixCache.longest_prefix`` does) against the per-slot scan it replaced (one
:func:`kvrt.prefixes.common_prefix` a slot, each a NumPy pass that releases the GIL and takes it
back), each alone and with one busy Python thread beside it (an HTTP thread parsing the next
turn's bodies): there every hand-off of the GIL may cost the lookup a whole switch interval
(Python's 5 ms, or the 0.5 ms of ``kvrt serve --gil-switch-s 0.0005``).
Both answer the same slot and length, checked in each benchmark.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvrt.prefixes import common_prefix
from kvrt.runtime.slot_tokens import SlotTokens

SLOTS, DOCUMENT, OWN, TURN = 32, 4096, 600, 128
rng = np.random.default_rng(0)
document = rng.integers(0, 150_000, DOCUMENT)
rows = [np.concatenate([document, rng.integers(0, 150_000, OWN)]) for _ in range(SLOTS)]
prompt = np.concatenate([rows[5], rng.integers(0, 150_000, TURN)])
table = SlotTokens(SLOTS)
for slot, row in enumerate(rows):
    table.extend(slot, row)


def per_slot_scan() -> tuple[int, int]:
    lengths = [common_prefix(row, prompt) for row in rows]
    best = max(range(SLOTS), key=lengths.__getitem__)
    return best, lengths[best]


def one_table_pass() -> tuple[int, int]:
    lengths = table.common_prefixes(prompt)
    best = int(lengths.argmax())
    return best, int(lengths[best])


@pytest.fixture(params=[("alone", None), ("beside a busy thread", None), ("beside a busy thread", 0.0005)],
                ids=["alone", "busy thread", "busy thread, switch 0.5 ms"])
def contention(request: pytest.FixtureRequest) -> Iterator[str]:
    """No other thread, or one busy Python thread under Python's switch interval or ``kvrt serve --gil-switch-s``'s."""
    label, switch_s = request.param
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    default_switch_s = sys.getswitchinterval()
    sys.setswitchinterval(switch_s or default_switch_s)
    if label != "alone":
        busy.start()
    try:
        yield f"{label}, switch interval {sys.getswitchinterval() * 1e3:g} ms"
    finally:
        stop.set()
        if busy.is_alive():
            busy.join()
        sys.setswitchinterval(default_switch_s)


@pytest.mark.parametrize("lookup", [per_slot_scan, one_table_pass], ids=["per-slot scan", "one table pass"])
def test_longest_prefix_lookup(benchmark, contention: str, lookup: Callable[[], tuple[int, int]]) -> None:
    benchmark.extra_info["contention"] = contention
    assert benchmark(lookup) == (5, DOCUMENT + OWN)
