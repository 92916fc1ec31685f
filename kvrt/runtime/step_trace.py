"""Where an engine step's time went: its phases timed, summed over the run, and a line of JSON per step.

A step of :meth:`kvrt.runtime.batching.Engine.step` has four phases: admission (commands,
deadlines, placing waiting requests), filling the batch, ``llama_decode`` until its outputs
are ready (the cell bookkeeping runs under it), and sampling with streaming out.
:class:`StepTimer` stamps them as the worker goes (:class:`StepTimes`); :class:`StepClock`
sums them for the engine's counters (:class:`kvrt.runtime.requests.EngineStats`), which sum
a run up; a trace says which steps were slow and what they carried: decode rows, prompt
chunks, sequences, the micro-batches llama.cpp split the batch into
(:mod:`kvrt.engine.micro_batches`) and the four phases in milliseconds. ``kvrt serve
--step-trace DIR`` writes one file per model; ``tools/step_trace_summary.py`` groups a
file's steps by what they carried.

Apart from the engine so that one definition of a phase serves the counters and the trace:
both are read from the same :class:`StepTimes`, so they always agree. Written on the engine's
thread only, line-buffered (a trace read while the server runs is whole up to its last step);
the cost when tracing is off is one ``None`` check a step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kvrt.errors import KvrtError


@dataclass(frozen=True)
class StepTimes:
    """One step's phase boundaries on the ``time.perf_counter`` clock (seconds): it started (admission), began
    filling its batch, decoding it, sampling, and ended; ``host_cpu``: the worker thread's CPU time in the three
    host phases (admit, fill, sample): their wall time less it is time the worker waited (for the GIL another
    thread held, or blocked). A step whose rows have no outputs (prompt chunks that end inside their prompts) is
    not waited for on a GPU: its decode phase is llama_decode's launch, and the compute's rest lands in the next
    step's decode phase."""

    start: float
    fill: float
    decode: float
    sample: float
    end: float
    host_cpu: float

    @property
    def admit_s(self) -> float:
        return self.fill - self.start

    @property
    def fill_s(self) -> float:
        return self.decode - self.fill

    @property
    def decode_s(self) -> float:
        return self.sample - self.decode

    @property
    def sample_s(self) -> float:
        return self.end - self.sample


class StepTimer:
    """Stamps one step's phases as the worker goes through them: made as the step starts, then :meth:`filling`,
    :meth:`decoding` and :meth:`sampling` as each phase begins, and :meth:`done` at its end."""

    def __init__(self) -> None:
        self._start, self._cpu = time.perf_counter(), time.thread_time()
        self._fill = self._decode = self._sample = self._host_cpu = 0.0

    def filling(self) -> None:
        self._fill = time.perf_counter()

    def decoding(self) -> None:
        self._decode, cpu = time.perf_counter(), time.thread_time()
        self._host_cpu = cpu - self._cpu  # admit and fill

    def sampling(self) -> None:
        self._sample, self._cpu = time.perf_counter(), time.thread_time()

    def done(self) -> StepTimes:
        end, cpu = time.perf_counter(), time.thread_time()
        return StepTimes(self._start, self._fill, self._decode, self._sample, end, self._host_cpu + cpu - self._cpu)


@dataclass
class StepClock:
    """Where the steps that decoded a batch spent their wall time (seconds, summed), phase by phase (see
    :class:`StepTimes`)."""

    admit_s: float = 0.0
    fill_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    host_cpu_s: float = 0.0

    @property
    def busy_s(self) -> float:
        return self.admit_s + self.fill_s + self.decode_s + self.sample_s

    def add(self, times: StepTimes) -> None:
        self.admit_s += times.admit_s
        self.fill_s += times.fill_s
        self.decode_s += times.decode_s
        self.sample_s += times.sample_s
        self.host_cpu_s += times.host_cpu


@dataclass(frozen=True)
class StepRecord:
    """One step that decoded a batch. Times in milliseconds; ``host_cpu_ms``: the worker's CPU time in the admit,
    fill and sample phases (their wall time less it is time the worker waited, e.g. for the GIL)."""

    t_s: float  # when the step started, seconds on the engine's perf_counter clock
    admit_ms: float
    fill_ms: float
    decode_ms: float
    sample_ms: float
    host_cpu_ms: float
    tokens: int  # tokens in the batch
    decode_rows: int  # of which sampled tokens of decoding choices
    prompt_tokens: int  # and prompt tokens, in
    prompt_chunks: int  # this many chunks
    sequences: int  # distinct sequences (slots) in the batch
    micro_batches: int  # llama.cpp's split of the batch (each reads all weights once)
    live: int  # requests running after admission
    queued: int  # requests waiting
    layout: str  # "split" or "unified"
    pads: int = 0  # throwaway tokens in idle slots between the batch's sequences (not in ``tokens``)
    shape: list[list[int]] = field(default_factory=list)  # [slot, tokens] of each sequence, pads too, slot order:
    # what llama.cpp split into micro_batches (kvrt.engine.micro_batches.split_per_stream replays it)
    waited_ms: float = 0.0  # the longest a request placed since the previous step waited in the queue (from its
    # submit: a layout switch made for it, slots it waited for); 0 when none was placed


class StepTrace:
    """Appends :class:`StepRecord` lines to ``path`` (made with its folder if missing; a path that cannot be
    written is a :class:`kvrt.errors.KvrtError` naming it); :meth:`close` when done."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: TextIO | None = self.path.open("a", buffering=1, encoding="utf-8")
        except OSError as exc:
            raise KvrtError(f"step trace: cannot write {self.path}: {exc.strerror or exc}") from None

    def record(self, step: StepRecord) -> None:
        if self._file is not None:  # vars, not asdict: its deep copy of the shape cost ~70 us of the engine's step
            self._file.write(json.dumps(vars(step), separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str | Path) -> list[StepRecord]:
    """Every step of a trace file. A last line cut off mid-write (the server was killed) is left out; any other
    line that is not a step is a :class:`ValueError` naming the file and line."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    steps = []
    for number, line in enumerate(lines, 1):
        try:
            steps.append(StepRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as exc:
            if number == len(lines) and not line.endswith("}"):
                break
            raise ValueError(f"{path}:{number}: not a step record ({exc})") from None
    return steps
