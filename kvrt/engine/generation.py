"""Prefill and text generation for one sequence, and the per-sequence stop logic
that batched generators (fan-out, the scheduler) reuse."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvrt.checks import INT32_MAX, check_int, check_text, shown
from kvrt.engine.batch import Batch
from kvrt.engine.context import Context
from kvrt.engine.decode_step import Feed, step
from kvrt.engine.model import Model
from kvrt.engine.prompt import prompt_tokens
from kvrt.engine.sampling import Sampler, SamplingParams
from kvrt.errors import InvalidArgument, KvrtError

ProgressFn = Callable[[int, int], None]
"""Called as ``progress(tokens_done, tokens_total)`` after each prefill chunk."""


@dataclass(frozen=True)
class GenerationParams:
    """When a sequence stops: ``max_tokens`` generated, an end-of-generation token (unless ``ignore_eos``: then it is
    kept as an ordinary token, so exactly ``max_tokens`` come out when no stop string ends it), or a stop string.

    Checked on construction: ``max_tokens`` an int in [1, 2**31 - 1], ``stop`` a tuple
    (a list is converted) of non-empty strings, ``sampling`` a :class:`SamplingParams`.
    """

    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_tokens", check_int(self.max_tokens, "max_tokens", low=1, high=INT32_MAX))
        if not isinstance(self.stop, (tuple, list)):
            raise InvalidArgument(f"stop must be a tuple of strings, got {shown(self.stop)}")
        object.__setattr__(self, "stop", tuple(check_text(s, f"stop[{i}]") for i, s in enumerate(self.stop)))
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidArgument(f"sampling must be a SamplingParams, got {shown(self.sampling)}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be a bool, got {shown(self.ignore_eos)}")


@dataclass
class Completion:
    """What one sequence generated and why it stopped (``eog``, ``length`` or ``stop``).

    ``eog_token`` is the end-of-generation token that ended it (not part of ``tokens``).
    """

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    eog_token: int | None = None

    @property
    def sampled(self) -> list[int]:
        """Every token the model chose, in order: ``tokens`` and the ``eog_token`` if one ended it."""
        return self.tokens + ([self.eog_token] if self.eog_token is not None else [])


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string."""
    return max((k for stop in stops for k in range(min(len(stop) - 1, len(text)), 0, -1)
                if text.endswith(stop[:k])), default=0)


class SequenceStream:
    """Accumulates one sequence's generated tokens and decides when it is done.

    Text is decoded incrementally (a token may end inside a UTF-8 character) and a
    stop string is cut from the text, never shown, even when it spans tokens:
    :meth:`release` hands out only text that no later token can turn into part of one.
    """

    def __init__(self, model: Model, params: GenerationParams) -> None:
        self.model = model
        self.params = params
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.eog_token: int | None = None
        self.sent = 0  # characters of ``text`` handed out by release() / rest()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int) -> bool:
        """Record a sampled token; returns True when the sequence must stop."""
        if self.done:
            raise KvrtError("sequence already finished")
        if not self.params.ignore_eos and self.model.is_eog(token):
            self.finish_reason = "eog"
            self.eog_token = token
            self.text += self._decoder.decode(b"", final=True)
            return True
        self.tokens.append(token)
        self.text += self._decoder.decode(self.model.token_to_piece(token))
        for stop in self.params.stop:
            cut = self.text.find(stop)
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish_reason = "stop"
                return True
        if len(self.tokens) >= self.params.max_tokens:
            self.text += self._decoder.decode(b"", final=True)
            self.finish_reason = "length"
            return True
        return False

    def end(self, reason: str) -> None:
        """Finish before the sequence would have (``cancelled``, ``deadline``): the text so far is the answer."""
        if not self.done:
            self.text += self._decoder.decode(b"", final=True)
            self.finish_reason = reason

    def release(self) -> str:
        """Text that can go out now: everything new, less what could still begin a stop string."""
        end = len(self.text) if self.done else len(self.text) - held_back(self.text, self.params.stop)
        out = self.text[self.sent:max(end, self.sent)]
        self.sent += len(out)
        return out

    def rest(self) -> str:
        """The text not released yet (at the end)."""
        out = self.text[self.sent:]
        self.sent += len(out)
        return out

    def completion(self, prompt_tokens: int = 0, timings_ms: dict[str, float] | None = None) -> Completion:
        return Completion(self.text, list(self.tokens), self.finish_reason or "length", prompt_tokens,
                          dict(timings_ms or {}), self.eog_token)


def prefill(
    ctx: Context,
    tokens: Sequence[int],
    *,
    seq_id: int = 0,
    start_pos: int | None = None,
    batch: Batch | None = None,
    progress: ProgressFn | None = None,
    logits_last: bool = True,
    after_chunk: Callable[[int, int], None] | None = None,
) -> int:
    """Decode ``tokens`` into ``seq_id`` in chunks of ``n_batch``; returns the logits row.

    Positions continue from what the sequence already holds unless ``start_pos`` says
    otherwise. The returned row indexes the last chunk's batch and stays valid until
    the next decode on this context.

    ``after_chunk(p0, p1)`` runs after each chunk's ``llama_decode`` returns, with the
    positions ``[p0, p1)`` it put into the cache. On a GPU build ``llama_decode`` returns
    while the chunk's last ubatch may still be computing (llama.cpp synchronises on the
    next decode or output read), so host-side work done here, such as cell bookkeeping,
    runs under the GPU's compute instead of after it.
    """
    if not tokens:
        raise KvrtError("prefill needs at least one token")
    feed = Feed(seq_id, ctx.seq_len(seq_id) if start_pos is None else start_pos, tokens, logits=logits_last)
    own = batch is None
    work = Batch(ctx.n_batch) if batch is None else batch
    row = -1
    try:
        while not feed.finished:
            (part,) = step(ctx, work, [feed])
            if after_chunk is not None:
                after_chunk(part.p0, part.p1)
            if progress is not None:
                progress(feed.done, len(tokens))
            row = work.n_tokens - 1  # the chunk's last token (its logits only with logits_last)
    finally:
        if own:
            work.close()
    return row


def generate(
    ctx: Context,
    prompt: str | Sequence[int],
    params: GenerationParams | None = None,
    *,
    seq_id: int = 0,
    progress: ProgressFn | None = None,
    on_text: Callable[[str], None] | None = None,
    until: Callable[[], str | None] | None = None,
) -> Completion:
    """Complete ``prompt`` on ``seq_id``, continuing after whatever the sequence holds.

    ``on_text`` receives the completion's text piece by piece as it is sampled (never a
    piece of a stop string); the pieces join to :attr:`Completion.text`. ``until`` is
    asked after every sampled token; a reason it returns (``"cancelled"``, ``"deadline"``)
    ends the completion there, with that ``finish_reason``.

    Invariant: the last token of :attr:`Completion.sampled` is returned but not decoded
    into the KV cache (nothing needs its logits yet), every earlier one is. A caller
    continuing the conversation must feed it first with its next prompt, or the sequence
    stops being the state of its transcript (the scheduler's agents do).
    """
    params = GenerationParams() if params is None else params
    if not isinstance(params, GenerationParams):
        raise InvalidArgument(f"params must be a GenerationParams, got {shown(params)}")
    model = ctx.model
    tokens = prompt_tokens(model, prompt, "prompt", add_special=ctx.seq_len(seq_id) == 0)
    needed = ctx.seq_len(seq_id) + len(tokens) + params.max_tokens
    if needed > ctx.n_ctx_seq:
        raise KvrtError(f"prompt ({len(tokens)} tokens) + held ({ctx.seq_len(seq_id)}) + max_tokens "
                        f"({params.max_tokens}) = {needed} exceeds the sequence's {ctx.n_ctx_seq} cells")
    stream = SequenceStream(model, params)
    t0 = time.perf_counter()
    with Sampler(params.sampling) as sampler, Batch(max(ctx.n_batch, 1)) as batch:
        row = prefill(ctx, tokens, seq_id=seq_id, batch=batch, progress=progress)
        t_prefill = time.perf_counter()
        t_first = None
        while True:
            token = sampler.sample(ctx, row)
            if t_first is None:
                t_first = time.perf_counter()
            finished = stream.accept(token)
            if not finished and until is not None and (reason := until()) is not None:
                stream.end(reason)
                finished = True
            if on_text is not None and (piece := stream.release()):
                on_text(piece)
            if finished:
                break
            (part,) = step(ctx, batch, [Feed(seq_id, ctx.seq_len(seq_id), [token])])
            assert part.row is not None  # a one-token feed that wants logits lands with its row
            row = part.row
    t_end = time.perf_counter()
    timings = {
        "prefill_ms": (t_prefill - t0) * 1e3,
        "first_token_ms": ((t_first or t_end) - t0) * 1e3,
        "decode_ms": (t_end - t_prefill) * 1e3,
    }
    return stream.completion(len(tokens), timings)
