"""Sum up an engine step trace (``kvrt serve --step-trace DIR``, ``kvrt bench peer --step-trace``).

Usage: python tools/step_trace_summary.py TRACE.jsonl [...]

For each file: its steps grouped by what they carried (decode rows only, prompt chunks
only, both) and, within a group, by how many micro-batches llama.cpp split them into;
per group the steps, their share of the wall time, and the median milliseconds of each
phase: where a run's time went and what a step of each shape costs on that machine, and the longest a
request waited in the queue before a step placed it (a layout switch made for it counts). Then the
steps with the most micro-batches beyond what their tokens need, with their slots and tokens, and the
longest stretches between steps (the engine idle, or its thread waiting for the GIL).
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from kvrt.runtime.step_trace import StepRecord, read_trace

PHASES = ("admit_ms", "fill_ms", "decode_ms", "sample_ms")


def busy_ms(step: StepRecord) -> float:
    """The step's wall time: its four phases, from its start to its end."""
    return sum(getattr(step, phase) for phase in PHASES)


def shape(step: StepRecord) -> str:
    """What a step carried: ``decode``, ``prompt`` or ``mixed``."""
    if step.prompt_chunks == 0:
        return "decode"
    return "prompt" if step.decode_rows == 0 else "mixed"


def summary(steps: list[StepRecord]) -> list[str]:
    """Lines of a table: one per (shape, micro-batches) group, then the totals."""
    if not steps:
        return ["no steps"]
    groups: dict[tuple[str, int], list[StepRecord]] = defaultdict(list)
    for step in steps:
        groups[(shape(step), step.micro_batches)].append(step)
    total_ms = sum(map(busy_ms, steps))
    lines = [f"{'shape':>7} {'micro':>5} {'steps':>6} {'time %':>6} {'rows':>5} {'prompt':>6} "
             + " ".join(f"{p[:-3]:>7}" for p in PHASES) + f" {'waits':>7}   (medians, ms)"]
    for (kind, micro), group in sorted(groups.items()):
        share = 100 * sum(map(busy_ms, group)) / total_ms
        medians = [statistics.median(getattr(s, p) for s in group) for p in PHASES]
        waits = statistics.median(s.admit_ms + s.fill_ms + s.sample_ms - s.host_cpu_ms for s in group)
        lines.append(f"{kind:>7} {micro:>5} {len(group):>6} {share:>6.1f} "
                     f"{statistics.median(s.decode_rows for s in group):>5.0f} "
                     f"{statistics.median(s.prompt_tokens for s in group):>6.0f} "
                     + " ".join(f"{m:>7.2f}" for m in medians) + f" {waits:>7.2f}")
    wall_s = steps[-1].t_s - steps[0].t_s + busy_ms(steps[-1]) / 1e3
    lines.append(f"{len(steps)} steps, {total_ms / 1e3:.2f} s busy of {wall_s:.2f} s from the first step to the "
                 f"last's end; {sum(s.micro_batches for s in steps) / len(steps):.2f} micro-batches a step; "
                 f"a request waited in the queue up to {max(s.waited_ms for s in steps):.1f} ms")
    return lines + surplus(steps) + idle(steps)


def idle(steps: list[StepRecord], most: int = 3) -> list[str]:
    """The longest stretches between one step's end and the next one's start, with what that next step carried:
    where the engine had nothing to decode (every request ended, the next turns not yet placed) or its thread
    waited for the GIL between steps."""
    gaps = sorted(((after.t_s - before.t_s - busy_ms(before) / 1e3, after) for before, after in zip(steps, steps[1:])),
                  key=lambda gap: -gap[0])
    if not gaps:
        return []
    lines = [f"  {sum(gap for gap, _ in gaps):.3f} s between steps; the longest:"]
    return lines + [f"    {1e3 * gap:.1f} ms before a step of {after.decode_rows} decode rows and "
                    f"{after.prompt_tokens} prompt tokens, {after.live} running, {after.queued} queued, "
                    f"placed after waiting up to {after.waited_ms:.1f} ms" for gap, after in gaps[:most]]


def surplus(steps: list[StepRecord], ubatch: int = 512, most: int = 3) -> list[str]:
    """The steps with the most micro-batches beyond the fewest their tokens need (``ubatch`` a micro-batch, decode
    rows in one of their own), with their shapes as runs of consecutive slots: where the split cost passes (traces
    written before shapes were recorded have none to show)."""
    def beyond(step: StepRecord) -> int:
        return step.micro_batches - (-(-step.prompt_tokens // ubatch) + (step.decode_rows > 0))

    worst = sorted((s for s in steps if s.shape and beyond(s) > 0), key=lambda s: (-beyond(s), -s.decode_ms))
    return [f"  +{beyond(s)} micro-batches ({s.micro_batches} in {s.decode_ms:.1f} ms): {runs(s.shape)}"
            for s in worst[:most]]


def runs(shape: list[list[int]]) -> str:
    """``[slot, tokens]`` pairs in slot order as runs of consecutive slots with their tokens, e.g. ``0-2:129, 5:1``."""
    groups: list[list[list[int]]] = []
    for slot, n in shape:
        if groups and slot == groups[-1][-1][0] + 1:
            groups[-1].append([slot, n])
        else:
            groups.append([[slot, n]])

    def text(group: list[list[int]]) -> str:
        first, last = group[0][0], group[-1][0]
        tokens = [n for _, n in group]
        return (f"{first}-{last}" if last != first else f"{first}") + ":" + (
            str(tokens[0]) if len(set(tokens)) == 1 else "/".join(map(str, tokens)))

    return ", ".join(text(group) for group in groups)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    for name in argv:
        print(f"== {name}")
        try:
            steps = read_trace(Path(name))
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print("\n".join(summary(steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
