"""The batched scheduler's records: a model's shared engine, an agent, and one of its turns.

Apart from :mod:`kvrt.serve.batched` (the scheduler, which changes them under its lock)
so that :mod:`kvrt.serve.batched_store`, which saves and restores agents for it, takes
them without importing the scheduler.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvrt.accounting.devices import DeviceCharge
from kvrt.accounting.ledger import Reservation
from kvrt.engine.generation import GenerationParams
from kvrt.runtime.batching import Engine
from kvrt.runtime.requests import ChoiceEnd, RequestStream
from kvrt.serve.agent import ContextPolicy
from kvrt.serve.registry import LoadedModel
from kvrt.serve.results import DecodeResult
from kvrt.serve.service import TextFn


@dataclass
class BatchedPool:
    """One model's engine, its ledger charge and how many agents use it."""

    entry: LoadedModel
    engine: Engine
    reservation: Reservation | DeviceCharge  # a DeviceCharge where the registry placed the model on a device set
    agents: int = 0


@dataclass
class BatchedTurn:
    """One turn of an agent: what was asked and its future; once started, its prompt's tokens and engine stream."""

    prompt: str | Sequence[int]
    params: GenerationParams
    deadline: float | None
    on_text: TextFn | None
    future: Future[DecodeResult] = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)  # the prompt's tokens, once started
    stream: RequestStream | None = None
    end: ChoiceEnd | None = None
    first_token: float | None = None
    drained: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class BatchedAgent:
    """One agent of :class:`kvrt.serve.batched.BatchedScheduler`: its model's pool, context policy, transcript (its
    KV is exactly this, where the engine still holds it) and turns queued or running, one at a time."""

    agent_id: str
    pool: BatchedPool
    policy: ContextPolicy
    transcript: list[int] = field(default_factory=list)
    keep: int | None = None
    queue: deque[BatchedTurn] = field(default_factory=deque)
    running: BatchedTurn | None = None
    served_tokens: int = 0
    requests: int = 0
    version: int = 0  # bumped (under the scheduler's lock) whenever what a save writes changes
    saved_version: int = -1  # the version the state dir holds (kvrt.serve.batched_store)
    save_lock: threading.Lock = field(default_factory=threading.Lock)
