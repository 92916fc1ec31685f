"""The three agent workloads of ``kvrt bench peer`` as token ids: fanout, swarm and private.

Every prompt is drawn from the model's vocabulary, deterministically (a seed and the
workload's name seed one generator), and only from tokens the GGUF marks NORMAL (no
control, byte, unused or user-defined tokens, no BOS/EOS/UNK/PAD), so both servers take
the ids as plain text tokens. The vocabulary is read from the GGUF's metadata with the
``gguf`` package: the harness process never loads the model.

``fanout``
    one shared document + a question of the agent's own, one turn;
``swarm``
    a shared document + a task of the agent's own, then later turns that each append the
    previous completion's tokens and new tokens of the agent's own;
``private``
    a history of the agent's own, later turns appended the same way.

A later turn's prompt is the previous prompt, exactly the token ids the server returned
for the previous completion, and ``append`` new tokens (:meth:`Workload.next_prompt`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kvrt.errors import KvrtError

WORKLOADS = ("fanout", "swarm", "private")
NORMAL_TOKEN = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL, as gguf writes tokenizer.ggml.token_type
SPECIAL_IDS = ("bos", "eos", "unknown", "padding", "eot", "eom", "sep", "cls", "mask")


class WorkloadError(KvrtError):
    """A workload that cannot be built: bad sizes or a vocabulary without plain tokens."""


@dataclass(frozen=True)
class Sizes:
    """One workload's sizes in tokens: ``shared`` document (0: none), the agent's ``own`` first-turn tokens,
    ``turns``, the ``append`` new tokens of every later turn, and ``gen`` output tokens a turn."""

    shared: int
    own: int
    turns: int
    append: int
    gen: int

    def __post_init__(self) -> None:
        if self.shared < 0 or self.own < 1 or self.turns < 1 or self.gen < 1 or (self.turns > 1 and self.append < 1):
            raise WorkloadError(f"workload sizes must be positive (shared may be 0, append only matters after the "
                                f"first turn): {self}")

    @property
    def cells_per_agent(self) -> int:
        """Cells one agent's history holds at its last token: every prompt token and every output token."""
        return self.shared + self.own + self.turns * self.gen + (self.turns - 1) * self.append

    def first_prompt_tokens(self) -> int:
        return self.shared + self.own


@dataclass(frozen=True)
class Workload:
    """``name``'s prompts for ``len(first)`` agents: each agent's first prompt and its later turns' new tokens."""

    name: str
    sizes: Sizes
    first: list[list[int]]
    appends: list[list[list[int]]]  # [agent][turn - 1]: the new tokens of that later turn

    @property
    def n_agents(self) -> int:
        return len(self.first)

    def next_prompt(self, agent: int, turn: int, previous: list[int], completion: list[int]) -> list[int]:
        """Turn ``turn`` (>= 1) of ``agent``: the previous prompt, the previous completion's ids, new tokens."""
        if not 1 <= turn < self.sizes.turns:
            raise WorkloadError(f"{self.name} has turns 0..{self.sizes.turns - 1}; turn {turn} has no new tokens")
        return previous + completion + self.appends[agent][turn - 1]


def safe_vocabulary(gguf_path: Path) -> list[int]:
    """Token ids the GGUF marks NORMAL, less its BOS/EOS/UNK/PAD/... ids, ascending."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields.get("tokenizer.ggml.token_type")
    if field is None:
        raise WorkloadError(f"{gguf_path} has no tokenizer.ggml.token_type: cannot tell plain tokens from control ones")
    special = set()
    for name in SPECIAL_IDS:
        f = reader.fields.get(f"tokenizer.ggml.{name}_token_id")
        if f is not None:
            special.add(int(f.parts[-1][0]))
    ids = [i for i, part in enumerate(field.data) if int(field.parts[part][0]) == NORMAL_TOKEN and i not in special]
    if len(ids) < 2:
        raise WorkloadError(f"{gguf_path} has {len(ids)} NORMAL tokens: too few to draw prompts from")
    return ids


def build(name: str, sizes: Sizes, n_agents: int, vocabulary: list[int], seed: int) -> Workload:
    """``name``'s prompts for ``n_agents`` agents, a function of (``name``, ``sizes``, ``n_agents``, ``seed``,
    ``vocabulary``) only; the shape is all in ``sizes`` (``private`` is ``shared`` 0)."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; there are {', '.join(WORKLOADS)}")
    if n_agents < 1:
        raise WorkloadError(f"{n_agents} agents: a workload needs at least one")
    rng = random.Random(f"{seed}:{name}")

    def draw(n: int) -> list[int]:
        return [vocabulary[rng.randrange(len(vocabulary))] for _ in range(n)]

    shared = draw(sizes.shared)
    first = [shared + draw(sizes.own) for _ in range(n_agents)]
    appends = [[draw(sizes.append) for _ in range(sizes.turns - 1)] for _ in range(n_agents)]
    return Workload(name, sizes, first, appends)
