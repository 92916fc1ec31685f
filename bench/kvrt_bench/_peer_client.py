"""N agents driving one OpenAI server at once, streaming, and what each turn measured.

Every agent is a thread with its own connection; all of them start together (a barrier)
and each sends its next turn when the previous one finished (a closed loop). A turn is
one streamed ``POST /v1/completions``; its time to first token is from sending the
request to the first chunk that carries an output token. A later turn needs the whole
previous completion (its prompt is built from its ids), so an agent whose turn failed or
came back short stops there: those turns count as lost, never as fast.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrt.serve.results import percentiles
from kvrt_bench._peer_workloads import Workload


@dataclass
class TurnResult:
    """One request: whose (``agent``, ``turn``), how long its prompt was, when it was sent, when its first token
    and its end arrived (``time.perf_counter()`` seconds), the completion's ids (what the next turn's prompt
    extends), and what the server reported. ``received`` output tokens: the ids streamed, or, where the stream
    left ids out but sent all the text (``retokenized``), the count the server reported."""

    agent: int
    turn: int
    prompt_tokens: int
    expected: int
    sent_s: float
    first_s: float | None = None
    end_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    reported: int | None = None  # completion tokens in the server's usage
    cached: int | None = None  # prompt tokens the server reported as cached
    error: str | None = None
    retokenized: bool = False  # the stream's ids had a gap; the ids are the server's tokenization of the text
    received: int = 0

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_s is None else (self.first_s - self.sent_s) * 1e3

    @property
    def lost(self) -> int:
        """Output tokens asked for and not received."""
        return max(0, self.expected - self.received)

    @property
    def complete(self) -> bool:
        return self.error is None and self.lost == 0


class Endpoint(Protocol):
    """One server arm as the client sees it: where it listens and how its requests and chunks look."""

    host: str
    port: int

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]: ...

    def chunk_tokens(self, chunk: dict[str, Any]) -> list[int]: ...

    def chunk_usage(self, chunk: dict[str, Any]) -> tuple[int | None, int | None]: ...

    def fill_gap(self, result: TurnResult) -> None: ...


def stream_turn(endpoint: Endpoint, agent: int, turn: int, prompt: list[int], max_tokens: int,
                timeout_s: float) -> TurnResult:
    """One streamed completion of ``prompt``; a failure is recorded in the result, never raised."""
    result = TurnResult(agent, turn, len(prompt), max_tokens, time.perf_counter())
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(endpoint.body(prompt, max_tokens)),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read()[:300].decode(errors='replace')}"
            return result
        for raw in iter(response.readline, b""):
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            _take_chunk(endpoint, result, json.loads(data))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end_s = time.perf_counter()
        result.received = len(result.tokens)
        conn.close()
    if result.error is None and result.reported is not None and len(result.tokens) < result.reported:
        endpoint.fill_gap(result)
    return result


def _take_chunk(endpoint: Endpoint, result: TurnResult, chunk: dict[str, Any]) -> None:
    if "error" in chunk:
        result.error = str(chunk["error"])[:300]
        return
    tokens = endpoint.chunk_tokens(chunk)
    if tokens and result.first_s is None:
        result.first_s = time.perf_counter()
    result.tokens += tokens
    for choice in chunk.get("choices") or ():
        result.text += choice.get("text") or ""
    reported, cached = endpoint.chunk_usage(chunk)
    result.reported = reported if reported is not None else result.reported
    result.cached = cached if cached is not None else result.cached


def run_workload(endpoint: Endpoint, workload: Workload, timeout_s: float) -> tuple[float, list[TurnResult]]:
    """Every agent's turns, all agents at once; the wall seconds from the first request sent to the last answer
    received, and every turn's result (agent, then turn order)."""
    results: list[list[TurnResult]] = [[] for _ in range(workload.n_agents)]
    gate = threading.Barrier(workload.n_agents)

    def agent(i: int) -> None:
        gate.wait()
        prompt = workload.first[i]
        for turn in range(workload.sizes.turns):
            if turn:
                prompt = workload.next_prompt(i, turn, prompt, results[i][-1].tokens)
            results[i].append(stream_turn(endpoint, i, turn, prompt, workload.sizes.gen, timeout_s))
            if not results[i][-1].complete:
                return

    threads = [threading.Thread(target=agent, args=(i,), name=f"agent{i}") for i in range(workload.n_agents)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    flat = [r for rows in results for r in rows]
    wall = max(r.end_s for r in flat) - min(r.sent_s for r in flat)
    return wall, flat


def turn_metrics(results: Sequence[TurnResult], n_agents: int, turns: int, gen: int,
                 wall_s: float) -> dict[str, Any]:
    """A workload's figures: wall time, output tokens/s, TTFT p50/p99 per turn (1-based), the client's own time
    between an agent's turns (p50/p99 of a turn's send less the agent's last turn's end: what a server's hold for
    the next turn has to cover on top of its own work), and what was lost: tokens of requests never sent (an agent
    stopped early) count too."""
    received = sum(r.received for r in results)
    expected = n_agents * turns * gen
    out: dict[str, Any] = {"wall_s": wall_s, "output_tokens": received, "output_tokens_per_s": received / wall_s,
                           "requests": len(results), "requests_expected": n_agents * turns,
                           "incomplete_requests": sum(not r.complete for r in results),
                           "lost_tokens": expected - received,
                           "errors": sorted({r.error for r in results if r.error})[:5],
                           "retokenized_requests": sum(r.retokenized for r in results),
                           "cached_prompt_tokens": sum(r.cached or 0 for r in results),
                           "prompt_tokens": sum(r.prompt_tokens for r in results)}
    for turn in range(turns):
        ttft = [t for r in results if r.turn == turn and (t := r.ttft_ms) is not None]
        p = percentiles(ttft)
        out[f"ttft_p50_ms_turn{turn + 1}"], out[f"ttft_p99_ms_turn{turn + 1}"] = p.p50, p.p99
    ended = {(r.agent, r.turn): r.end_s for r in results}
    gaps = percentiles([(r.sent_s - ended[r.agent, r.turn - 1]) * 1e3 for r in results
                        if (r.agent, r.turn - 1) in ended])
    out["client_gap_p50_ms"], out["client_gap_p99_ms"] = gaps.p50, gaps.p99
    return out


def token_agreement(a: Sequence[TurnResult], b: Sequence[TurnResult]) -> float:
    """Share of ``a``'s output tokens that ``b`` produced too, at the same (agent, turn, position) up to the first
    difference of each request (greedy on the same build, but batches of other shapes round differently)."""
    by_key = {(r.agent, r.turn): r.tokens for r in b}
    same = total = 0
    for r in a:
        other = by_key.get((r.agent, r.turn), [])
        total += len(r.tokens)
        same += next((k for k, (x, y) in enumerate(zip(r.tokens, other)) if x != y), min(len(r.tokens), len(other)))
    return same / total if total else 1.0
