"""Sampler chains: greedy, or temperature with top-k / top-p / min-p and a seed; optionally a GBNF
grammar, logit biases and repetition / frequency / presence penalties in front."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvrt._handle import NativeHandle, OwnsHandle
from kvrt.bindings import capture, explain, ffi, lib
from kvrt.checks import INT32_MAX, check_int, check_real, check_text
from kvrt.engine.context import Context
from kvrt.errors import DecodeError, InvalidArgument, KvrtError, LlamaError

if TYPE_CHECKING:
    from kvrt.engine.model import Model


LLAMA_DEFAULT_SEED = 2**32 - 1  # llama.cpp draws a random seed for this value: it is no seed at all
MAX_SEED = LLAMA_DEFAULT_SEED - 1
SEEDS = MAX_SEED + 1  # seeds are [0, MAX_SEED]; seed + i wraps modulo this


def check_seed(value: object) -> int:
    """A reproducible seed: an int in [0, 2**32 - 2] (2**32 - 1 is llama.cpp's "pick a random seed")."""
    if not isinstance(value, bool) and isinstance(value, int) and value == LLAMA_DEFAULT_SEED:
        raise InvalidArgument(f"seed {LLAMA_DEFAULT_SEED} is llama.cpp's LLAMA_DEFAULT_SEED (a new random seed on "
                              f"every run, not reproducible); give a seed in [0, {MAX_SEED}]")
    return check_int(value, "seed", low=0, high=MAX_SEED)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; ``temperature`` 0 means greedy (argmax).

    ``seed`` is in [0, 2**32 - 2] and always reproducible: llama.cpp's random-seed value
    2**32 - 1 is refused (draw a seed yourself for a random one).

    Every value is checked and normalised on construction (plain ``int``/``float``), so
    a chain is never built from a NaN, an infinity, a bool or a negative temperature.
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0
    repeat_penalty: float = 1.0  # llama.cpp's repetition penalty over the last ``penalty_last_n`` tokens (1: off)
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence (OpenAI's meaning; 0: off)
    presence_penalty: float = 0.0  # subtracted once if the token occurred at all (0: off)
    penalty_last_n: int = 64  # how many of the latest generated tokens the penalties look at
    grammar: str | None = None  # GBNF text (root rule ``root``) the output must match
    # (token, bias) pairs added to those tokens' logits before anything else (OpenAI's logit_bias); a mapping is
    # accepted and stored as pairs sorted by token
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        checked: dict[str, object] = {
            "temperature": check_real(self.temperature, "temperature", low=0.0),
            "top_k": check_int(self.top_k, "top_k", low=0, high=INT32_MAX),
            "top_p": check_real(self.top_p, "top_p", low=0.0, high=1.0, low_open=True),
            "min_p": check_real(self.min_p, "min_p", low=0.0, high=1.0, high_open=True),
            "seed": check_seed(self.seed),
            "repeat_penalty": check_real(self.repeat_penalty, "repeat_penalty (1: off)", low=0.0, low_open=True),
            "frequency_penalty": check_real(self.frequency_penalty, "frequency_penalty"),
            "presence_penalty": check_real(self.presence_penalty, "presence_penalty"),
            "penalty_last_n": check_int(self.penalty_last_n, "penalty_last_n", low=0, high=INT32_MAX),
            "grammar": None if self.grammar is None else _check_grammar(self.grammar),
            "logit_bias": _check_logit_bias(self.logit_bias),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """True when any penalty is active (a llama.cpp penalties stage goes into the chain)."""
        active = self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        return active and self.penalty_last_n > 0


def _check_logit_bias(bias: Mapping[int, float] | Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """(token, bias) pairs sorted by token: tokens non-negative int32 and given once, biases finite."""
    pairs = list(bias.items() if isinstance(bias, Mapping) else bias)
    checked = sorted((check_int(token, "logit_bias token", low=0, high=INT32_MAX),
                      check_real(value, f"logit_bias of token {token}")) for token, value in pairs)
    for (a, _), (b, _) in zip(checked, checked[1:]):
        if a == b:
            raise InvalidArgument(f"logit_bias gives token {a} more than one bias")
    return tuple(checked)


def _check_grammar(grammar: object) -> str:
    """GBNF text llama.cpp can be handed: non-blank, UTF-8, no NUL (its parser reads a C string)."""
    text = check_text(grammar, "grammar")
    if not text.strip() or "\x00" in text:
        raise InvalidArgument("grammar must be non-empty GBNF text without NUL characters")
    return text


def _logit_bias_stage(model: Model, bias: tuple[tuple[int, float], ...]) -> Any:
    """llama.cpp's logit-bias sampler; a token outside the vocabulary is refused here (llama.cpp would
    write past the logits)."""
    for token, _ in bias:
        if token >= model.n_vocab:
            raise InvalidArgument(f"logit_bias: token {token} is outside the vocabulary [0, {model.n_vocab})")
    entries = ffi.new("llama_logit_bias[]", list(bias))
    stage = lib().llama_sampler_init_logit_bias(model.n_vocab, len(bias), entries)
    if stage == ffi.NULL:
        raise LlamaError("llama_sampler_init_logit_bias", f"returned NULL for {len(bias)} biases")
    return stage


class _Grammar(OwnsHandle):
    """llama.cpp's grammar sampler for one sequence, kept out of the chain (see :meth:`Sampler.sample`)."""

    def __init__(self, model: Model, grammar: str) -> None:
        with capture() as lines:
            ptr = lib().llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
        if ptr == ffi.NULL:
            raise LlamaError("llama_sampler_init_grammar", explain(lines, "llama.cpp could not parse the grammar"))
        self._handle = NativeHandle(ptr, lib().llama_sampler_free, "grammar sampler")
        self.ids = np.arange(model.n_vocab, dtype=np.int32)

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts ``token`` next (a one-candidate array through the grammar)."""
        one = ffi.new("llama_token_data[1]", [(token, 0.0, 0.0)])
        array = ffi.new("llama_token_data_array *", (one, 1, -1, False))
        lib().llama_sampler_apply(self.ptr, array)
        return bool(np.isfinite(array.data[0].logit))


class Sampler(OwnsHandle):
    """A llama.cpp sampler chain built from :class:`SamplingParams` (one per sequence).

    A grammar, logit biases or penalties need the vocabulary: pass ``model``. The chain is
    logit biases, penalties, then greedy or top-k / top-p / min-p / temperature / seeded draw; a grammar is applied
    beside it (:meth:`sample`).
    """

    def __init__(self, params: SamplingParams | None = None, *, model: Model | None = None) -> None:
        self.params = params or SamplingParams()
        if model is None and (self.params.grammar is not None or self.params.penalized or self.params.logit_bias):
            raise KvrtError("a grammar, logit biases or penalties need the model's vocabulary: "
                            "Sampler(params, model=model)")
        chain = lib().llama_sampler_chain_init(lib().llama_sampler_chain_default_params())
        if chain == ffi.NULL:
            raise KvrtError("llama_sampler_chain_init returned NULL")
        self._handle = NativeHandle(chain, lib().llama_sampler_free, "sampler")
        p = self.params
        self._grammar: _Grammar | None = None
        if model is not None:
            self._add_constraints(chain, model)
        if p.greedy:
            stages = [lib().llama_sampler_init_greedy()]
        else:
            stages = [
                lib().llama_sampler_init_top_k(p.top_k),
                lib().llama_sampler_init_top_p(p.top_p, 1),
                lib().llama_sampler_init_min_p(p.min_p, 1),
                lib().llama_sampler_init_temp(p.temperature),
                lib().llama_sampler_init_dist(p.seed),
            ]
        for stage in stages:
            if stage == ffi.NULL:
                raise KvrtError(f"llama.cpp could not create a sampler stage for {p}")
            lib().llama_sampler_chain_add(chain, stage)  # the chain now owns the stage

    def _add_constraints(self, chain: Any, model: Model) -> None:
        """The grammar sampler, the logit-bias and penalty stages (owned by the chain as soon as they exist)."""
        p = self.params
        if p.grammar is not None:
            self._grammar = _Grammar(model, p.grammar)
        if p.logit_bias:
            lib().llama_sampler_chain_add(chain, _logit_bias_stage(model, p.logit_bias))
        if p.penalized:
            stage = lib().llama_sampler_init_penalties(model.n_vocab, p.penalty_last_n, p.repeat_penalty,
                                                       p.frequency_penalty, p.presence_penalty)
            if stage == ffi.NULL:
                raise LlamaError("llama_sampler_init_penalties", f"returned NULL for {p}")
            lib().llama_sampler_chain_add(chain, stage)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no grammar, penalties or logit biases: the chain keeps no state, its pick is the argmax
        (:meth:`Context.argmax` computes it for many rows at once)."""
        p = self.params
        return p.greedy and self._grammar is None and not p.penalized and not p.logit_bias

    def sample(self, ctx: Context, row: int) -> int:
        """Pick the next token from the logits of batch row ``row`` and accept it."""
        with ctx._handle.use():  # the context is not freed meanwhile (see Context.close)
            return self._sample(ctx, row)

    def _sample(self, ctx: Context, row: int) -> int:
        if self.plain_greedy:
            return ctx.argmax([row])[0]  # raises on a row without logits
        if not ctx.has_logits(row):
            # llama_sampler_sample asserts (aborts the process) on a row without logits.
            raise DecodeError("llama_sampler_sample", "no logits were computed for this row", row=row)
        if self._grammar is None:
            return int(lib().llama_sampler_sample(self.ptr, ctx.ptr, row))
        return self._sample_constrained(self._grammar, ctx.logits(row))

    def _sample_constrained(self, grammar: _Grammar, logits: np.ndarray) -> int:
        """The chain's pick when the grammar allows it, else the chain's pick among what the grammar allows.

        What llama.cpp's own server does: the grammar checks one token instead of the whole
        vocabulary (on a 262k-token vocabulary that is ~0.5 s a token on a CPU). Greedy picks
        are the same as grammar-first; a plain seeded draw keeps the constrained distribution.
        """
        token = self._pick(grammar, logits, constrained=False)
        if not grammar.allows(token):
            token = self._pick(grammar, logits, constrained=True)
        lib().llama_sampler_accept(grammar.ptr, token)
        lib().llama_sampler_accept(self.ptr, token)
        return token

    def _pick(self, grammar: _Grammar, logits: np.ndarray, *, constrained: bool) -> int:
        candidates = np.empty(logits.size, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        candidates["id"], candidates["logit"], candidates["p"] = grammar.ids, logits, 0.0
        array = ffi.new("llama_token_data_array *",
                        (ffi.from_buffer("llama_token_data[]", candidates), logits.size, -1, False))
        if constrained:
            lib().llama_sampler_apply(grammar.ptr, array)
            if not np.isfinite(candidates["logit"]).any():
                raise KvrtError("the grammar allows no token of the vocabulary at this point of the output")
        lib().llama_sampler_apply(self.ptr, array)
        if not 0 <= array.selected < array.size:
            raise KvrtError(f"the sampler chain selected no token (selected={array.selected})")
        token = int(array.data[array.selected].id)
        if constrained and not grammar.allows(token):  # accepting it would throw inside llama.cpp
            raise KvrtError(f"the sampler chain picked token {token}, which the grammar does not allow")
        return token

    def reset(self) -> None:
        lib().llama_sampler_reset(self.ptr)
        if self._grammar is not None:
            lib().llama_sampler_reset(self._grammar.ptr)

    def close(self) -> None:
        if getattr(self, "_grammar", None) is not None:
            self._grammar.close()  # type: ignore[union-attr]
        super().close()

