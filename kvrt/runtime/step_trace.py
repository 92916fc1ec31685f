"""A line of JSON per engine step: what the batch held and where the step's time went.

The engine's counters (:class:`kvrt.runtime.requests.EngineStats`) sum a run up; a trace
says which steps were slow and what they carried: decode rows, prompt chunks, sequences,
the micro-batches llama.cpp split the batch into (:mod:`kvrt.engine.micro_batches`) and the
four phases of :meth:`kvrt.runtime.batching.Engine.step` in milliseconds. ``kvrt serve
--step-trace DIR`` writes one file per model; ``tools/step_trace_summary.py`` groups a
file's steps by what they carried.

Written on the engine's thread only, line-buffered (a trace read while the server runs
is whole up to its last step); the cost when tracing is off is one ``None`` check a step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from kvrt.errors import KvrtError


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
        if self._file is not None:
            self._file.write(json.dumps(asdict(step), separators=(",", ":")) + "\n")

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
