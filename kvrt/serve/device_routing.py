"""Which of a model's engines (one per device it is loaded on) serves a request: prefix affinity, asked of the
placement policy.

An agent's history lives in the KV of the engine that served its last turn (a slot of its context, or a copy in
its host tier). Sending its next turn anywhere else recomputes that history, and on another device the result is
not even bit-identical (another device's kernels). So each engine is asked how much of the request's tokens it
holds (:meth:`kvrt.runtime.batching.Engine.cached_prefix`, on its worker) and how loaded it is, and the policy
(:meth:`kvrt.accounting.placement.FreeMemoryPolicy.route`) picks: the longest cached prefix, else the least loaded.
Nothing here reserves memory or changes an engine: routing is advice, the engine's admission still decides.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait

from kvrt.accounting.placement import Candidate, PlacementPolicy
from kvrt.errors import InvalidArgument
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import EngineClosed

ASK_TIMEOUT_S = 2.0  # an engine's worker answers between two steps
log = logging.getLogger("kvrt.serve.routing")


def candidates(engines: Mapping[int, Engine], tokens: Sequence[int],
               free_bytes: Mapping[int, int]) -> list[Candidate]:
    """Each device's engine as the policy sees it: its cached prefix of ``tokens``, its queued plus running
    requests, and its device's free bytes (0 where ``free_bytes`` has no entry). An engine that does not answer
    within ``ASK_TIMEOUT_S`` (a long step) or is closing counts as holding nothing: routing never fails a request."""
    asked: dict[int, Future[int]] = {}
    for device, engine in engines.items():  # all workers asked at once
        try:
            asked[device] = engine.cached_prefix(tokens)
        except EngineClosed:
            continue
    wait(asked.values(), ASK_TIMEOUT_S)
    out = []
    for device, engine in sorted(engines.items()):
        answer = asked.get(device)
        cached = answer.result() if answer is not None and answer.done() and answer.exception() is None else 0
        if answer is not None and not answer.done():
            log.warning("device %d's engine did not say what it holds within %g s; routing as if nothing",
                        device, ASK_TIMEOUT_S)
        stats = engine.stats()
        out.append(Candidate(device, cached, stats.queued + stats.active, free_bytes.get(device, 0)))
    return out


def route(engines: Mapping[int, Engine], tokens: Sequence[int], policy: PlacementPolicy,
          free_bytes: Mapping[int, int]) -> int:
    """The device whose engine should serve a request of ``tokens`` (one of ``engines``' keys)."""
    if not engines:
        raise InvalidArgument("routing a request needs at least one engine")
    return policy.route(candidates(engines, tokens, free_bytes))
