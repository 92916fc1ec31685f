"""OpenAI request bodies, validated and turned into engine requests (no HTTP here).

Bodies are checked with pydantic, strictly (a bool is not a number, a string is not a
number or a bool, numbers are finite, integers within what the engine can hold); a bad
field becomes an :class:`ApiError` (HTTP 400) whose ``param`` names it. Before that,
:func:`check_json` refuses JSON nested deeper than :data:`MAX_JSON_DEPTH` and text that
UTF-8 cannot encode (lone surrogates such as ``"\ud800"``), naming where. Sampling follows
OpenAI's meaning: ``temperature`` 0 is greedy, ``top_p`` 1 and no top-k / min-p unless the llama.cpp-style extensions
``top_k`` / ``min_p`` are given; ``frequency_penalty`` / ``presence_penalty`` (and the
``repetition_penalty`` extension) count every token generated so far; a missing
(or null) ``seed`` is drawn at random; a given one is in [0, 2**32 - 2] and reproducible
(2**32 - 1, and -1 which would wrap to it, are llama.cpp's "random seed": refused);
``ignore_eos`` (llama.cpp's and vLLM's extension) keeps generating past an
end-of-generation token, and ``return_tokens`` (llama.cpp's, text completions) puts each
choice's token ids beside its text, so a client can continue a completion
token-exactly; kvrt's ``exact_prefix`` (true / false; absent or null: the server's
``--exact-prefix``) makes the prompt's logits those of a cold evaluation of the same prompt,
bit for bit, however much of it is cached (:attr:`kvrt.runtime.requests.Request.exact`).
``logit_bias`` (token id -> [-100, 100]) is added to those tokens' logits by
llama.cpp's logit-bias sampler before any other stage. ``response_format`` ``json_object`` / ``json_schema``
constrain the output through llama.cpp's grammar sampler, the schema converted to
GBNF by llama-cpp-python's converter with integer bounds added (:mod:`kvrt.serve.json_grammar`;
a ``number``'s bounds are not enforced). Chat bodies take
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and messages with ``tool_calls`` (each
call's ``arguments`` JSON text of an object) or ``tool_call_id``; what they mean together is
checked in :mod:`kvrt.serve.chat_prompt`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from kvrt.engine.context import Context
from kvrt.engine.generation import GenerationParams
from kvrt.engine.model import Model
from kvrt.engine.sampling import MAX_SEED, SamplingParams
from kvrt.runtime.requests import MAX_LOGPROBS, Request
from kvrt.serve.api_error import ApiError

UNSUPPORTED = ("functions", "function_call", "suffix", "audio", "modalities", "prediction")
# Sampling parameters of llama-server / vLLM / text-generation-webui that kvrt's sampler does not implement, with
# the value that asks for nothing (what clients send when they always send every field); any other value is a 400
# naming them all rather than an output sampled differently from what was asked. No neutral value: None.
UNHONOURED_SAMPLING: dict[str, object] = {
    "typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
    "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
    "dry_sequence_breakers": None, "top_n_sigma": -1.0, "top_a": 0.0, "smoothing_factor": 0.0,
    "min_tokens": 0, "best_of": 1, "use_beam_search": False, "length_penalty": 1.0, "repeat_last_n": 64,
    "penalty_last_n": 64, "n_probs": 0, "samplers": None, "grammar": None, "json_schema": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
MAX_JSON_DEPTH = 64  # nesting of a request body (a chat body needs 4, a JSON schema rarely 20)
INT32_MAX = 2**31 - 1  # token counts and ids are int32 in llama.cpp
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
KEYED_FIELDS = frozenset({"logit_bias"})  # objects whose keys are data: a 400 names the key (logit_bias.50256)
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]  # OpenAI's range


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Body(_Strict):
    """Fields both endpoints share (OpenAI's, then llama.cpp / vLLM-style extensions)."""

    model: str
    max_tokens: TokenCount | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    top_k: int = Field(0, ge=0, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False  # llama.cpp / vLLM: an end-of-generation token does not end the output
    logit_bias: dict[str, LogitBias] | None = None  # token id (as a string, OpenAI's JSON) -> added to its logit
    exact_prefix: bool | None = None  # kvrt: reuse cached prefixes only as a cold prefill computes them (None: server)

    @field_validator("seed")
    @classmethod
    def _reproducible_seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_SEED:
            raise PydanticCustomError("seed_range", f"must be in [0, {MAX_SEED}], got {value} (2**32 - 1, and -1 "
                                      "which wraps to it, are llama.cpp's random seed, never reproducible; leave "
                                      "seed out or null for a random one)")
        return value


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    return_tokens: bool = False  # llama.cpp: every choice (and stream chunk) carries its token ids as ``tokens``


class ForkBody(_Body):
    """``/v1/kvrt/fork``: continue choice ``choice`` of completion ``completion_id`` with ``prompt``."""

    completion_id: str
    choice: int = Field(0, ge=0, le=INT32_MAX)
    prompt: str = ""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens: bool = False


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]  # OpenAI's rule


class FunctionCallBody(_Strict):
    """A function call in an assistant message of the history: ``arguments`` is JSON text of an object."""

    name: str = Field(min_length=1)
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise PydanticCustomError("invalid_arguments", f"must be JSON text of an object ({exc})") from None
        if not isinstance(parsed, dict):
            raise PydanticCustomError("invalid_arguments", "must be JSON text of an object, got "
                                      f"{type(parsed).__name__}")
        return value


class ToolCallBody(_Strict):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCallBody


class FunctionBody(_Strict):
    """A tool's function: ``parameters`` is its arguments' JSON schema (none: it takes no arguments)."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolBody(_Strict):
    type: Literal["function"]
    function: FunctionBody


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessageBody(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls (content may then be null)
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatBody(_Body):
    messages: list[ChatMessageBody] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class PinBody(_Strict):
    model: str
    prompt: str | list[int] | None = None
    messages: list[ChatMessageBody] | None = None
    exact_prefix: bool | None = None  # prefilled as exact requests are, so they can reuse it (None: the server's)


class MoveBody(_Strict):
    """``/v1/kvrt/agents/{agent}/move``: to the copy of ``model`` on ``device`` (``kvrt serve --replicas``)."""

    model: str
    device: int


class TokenizeBody(_Strict):
    """``/tokenize`` (llama-server's shape); ``model`` may be left out when the server has one model."""

    content: str
    add_special: bool = False  # llama-server's default: no BOS unless asked
    model: str | None = None


class DetokenizeBody(_Strict):
    """``/detokenize`` (llama-server's shape)."""

    tokens: list[TokenId]
    model: str | None = None


def check_vocab(model: Model, tokens: Sequence[int], param: str) -> None:
    """A 400 naming the first of ``tokens`` outside the model's vocabulary (``param[i]``)."""
    for i, token in enumerate(tokens):
        if not 0 <= token < model.n_vocab:
            raise ApiError(400, f"{param}[{i}]: token {token} is outside the vocabulary [0, {model.n_vocab})",
                           param=f"{param}[{i}]", code="invalid_token")


def pieces_text(model: Model, tokens: Sequence[int]) -> str:
    """The tokens' pieces (special tokens' text included) joined, as llama-server's ``/detokenize`` answers.

    Not ``llama_detokenize``, which drops a leading space a tokenizer added: a client that
    splits a text at token boundaries gets back exactly what it joins. Bytes are joined
    before decoding, so a character split across tokens survives.
    """
    return b"".join(model.token_to_piece(t, special=True) for t in tokens).decode("utf-8", "replace")


def _param(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_SCALARS = frozenset({int, float, bool, type(None)})  # what json.loads makes of a number, true/false and null


def check_json(body: Any) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and strings UTF-8 cannot encode (lone surrogates).

    Iterative (a hostile body must not exhaust the stack); the 400 names where the problem is.
    """
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        value, loc = stack.pop()
        if len(loc) > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at {_param(loc[:8])}"
                                "...)", code="nesting_too_deep")
        if isinstance(value, str):
            _check_encodable(value, loc)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_encodable(key, loc + (key,))
                stack.append((item, loc + (key,)))
        elif isinstance(value, list) and not _SCALARS.issuperset(map(type, value)):  # numbers need no check: a
            # list of token ids costs one pass over its items' types in C, not a Python pass asking each item; only
            # a list holding text or containers is walked (figures: bench/RESULTS.md, "A decode step's host time")
            stack.extend((item, loc + (i,)) for i, item in enumerate(value) if isinstance(item, (str, dict, list)))


def _check_encodable(text: str, loc: tuple[Any, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        param = _param(loc) or None
        where = f"{param}: " if param else ""
        raise ApiError(400, f"{where}a lone surrogate {text[exc.start]!r} at character {exc.start} is not text "
                            "(UTF-8 cannot encode it; send a valid surrogate pair or the character itself)",
                       param=param, code="invalid_text") from None


def parse(kind: type[_Strict], body: Any) -> Any:
    """``body`` validated as ``kind``; the first problem becomes a 400 naming its field."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        parsed = kind.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        # a union's members each report: the one that got furthest into the value says the most
        first = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
        # a union's error carries the member type as an extra location part: keep the field's path only
        names, where = _field_names(kind, first["loc"]), first["loc"]
        loc = [p for i, p in enumerate(where)
               if isinstance(p, int) or p in names or (i > 0 and where[i - 1] in KEYED_FIELDS)]
        param = _param(loc) or None
        raise ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                       code=first["type"]) from None
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise ApiError(400, f"{name} is not supported by kvrt's server", param=name, code="unsupported_parameter")
    if issubclass(kind, _Body):
        _refuse_unhonoured(body)
    return parsed


def _refuse_unhonoured(body: Mapping[str, Any]) -> None:
    """A 400 naming every sampling parameter in ``body`` that kvrt would otherwise silently ignore."""
    asked = [name for name, neutral in UNHONOURED_SAMPLING.items()
             if body.get(name) is not None and not _same(body[name], neutral)]
    if asked:
        listed = ", ".join(f"{name}={json.dumps(body[name])[:40]}" for name in asked)
        raise ApiError(400, f"{', '.join(asked)}: kvrt does not implement these sampling parameters ({listed}); leave "
                            "them out (or at their neutral value) and use temperature, top_p, top_k, min_p, the "
                            "penalties, logit_bias or response_format", param=asked[0], code="unsupported_parameter")


def _same(value: Any, neutral: object) -> bool:
    """``value`` is the neutral value (a number of the same value; a bool only as a bool)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return isinstance(value, (int, float)) and isinstance(neutral, (int, float)) and value == neutral


def _field_names(kind: type[_Strict], loc: Sequence[Any]) -> set[str]:
    """Every field name of the models along ``loc`` (to drop pydantic's union-member labels)."""
    names: set[str] = set()
    for model in (kind, ChatMessageBody, StreamOptions, ResponseFormat, JsonSchemaFormat, ToolCallBody,
                  FunctionCallBody, ToolBody, FunctionBody, NamedToolChoice, NamedFunction):
        names.update(model.model_fields)
    return names & {str(p) for p in loc}


def text_tokens(model: Model, text: str, *, limit: tuple[int, int] | None, param: str,
                add_special: bool = True, held: int = 0) -> list[int]:
    """``model.tokenize(text)``, special-token text parsed, after checking the text can fit.

    ``limit`` is (cells, the longest token's bytes): a text of more UTF-8 bytes than their
    product is more tokens than the cells, so it is refused before tokenizing (a tokenizer
    can take time quadratic in the text); ``held`` tokens come before the text. The 400 names ``param``.
    """
    if limit is not None:
        cells, piece = limit
        n_bytes = len(text.encode("utf-8"))
        if n_bytes > max(cells - held, 0) * piece:
            beside = f" left beside the {held} tokens before it"
            raise ApiError(400, f"{param}: {n_bytes} bytes of text are at least {-(-n_bytes // piece)} tokens (no "
                                f"token of this model is longer than {piece} bytes), more than the "
                                + (f"{max(cells - held, 0)} of the context's {cells} cells{beside}" if held
                                   else f"context's {cells} cells"), param=param,
                           code="context_length_exceeded")
    return model.tokenize(text, add_special=add_special, parse_special=True)


def longest_piece(model: Model) -> int:
    """Bytes of the model's longest token text (special tokens' text included)."""
    return max(1, max(max(len(model.token_to_piece(t)), len(model.token_to_piece(t, special=True)))
                      for t in range(model.n_vocab)))


def single_prompt(prompt: str | list[Any]) -> str | list[Any]:
    """A completions ``prompt``'s one prompt: its text or its token ids (a list of one text or one id list is
    unwrapped); more than one is refused."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: kvrt serves one prompt per request, got {len(prompt)}", param="prompt")
        unwrapped: str | list[Any] = prompt[0]
        return unwrapped
    return prompt


def completion_prompt(model: Model, prompt: str | list[Any], *, limit: tuple[int, int] | None = None) -> list[int]:
    """Tokens of a completions ``prompt``: text (special-token text parsed) or token ids; one prompt only.

    ``limit``: see :func:`text_tokens` (token ids beyond its cells are refused too).
    """
    prompt = single_prompt(prompt)
    if not isinstance(prompt, str) and limit is not None and len(prompt) > limit[0]:
        raise ApiError(400, f"prompt: {len(prompt)} tokens are more than the context's {limit[0]} cells",
                       param="prompt", code="context_length_exceeded")
    tokens = text_tokens(model, prompt, limit=limit, param="prompt") if isinstance(prompt, str) else prompt
    if not tokens:
        raise ApiError(400, "prompt: it is empty", param="prompt")
    n_vocab = model.n_vocab
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"prompt: token {bad} is outside the vocabulary [0, {n_vocab})", param="prompt")
    return list(tokens)


def grammar_of(response_format: ResponseFormat | None) -> str | None:
    """GBNF for ``response_format`` (``None`` for plain text)."""
    if response_format is None or response_format.type == "text":
        return None
    from kvrt.serve.json_grammar import schema_grammar

    schema: dict[str, Any] = {"type": "object"}
    if response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise ApiError(400, "response_format.json_schema is required for type json_schema",
                           param="response_format.json_schema")
        schema = response_format.json_schema.schema_ or schema
    return schema_grammar(schema, param="response_format")


def logit_bias_pairs(bias: Mapping[str, float] | None, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias``'s (token, bias) pairs; a key that is not a token id of the vocabulary is a 400 naming it."""
    pairs = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < n_vocab:
            raise ApiError(400, f"logit_bias.{key}: {key!r} is not a token id of the vocabulary [0, {n_vocab})",
                           param=f"logit_bias.{key}", code="invalid_token")
        pairs.append((token, value))
    return tuple(pairs)


def engine_request(body: _Body, prompt: list[int], *, n_cells: int, n_vocab: int, max_tokens: int | None,
                   default_max_tokens: int, logprobs: int | None, grammar: str | None = None,
                   exact_prefix: bool = False, agent: str | None = None,
                   at_end: Callable[[Context, int, tuple[int, ...]], None] | None = None,
                   deadline: float | None = None) -> Request:
    """The engine's :class:`Request` for a validated body.

    ``max_tokens`` None: ``default_max_tokens`` or whatever still fits the context beside
    the prompt and the other choices, whichever is smaller. ``grammar`` (forced tool calls)
    replaces ``response_format``'s. ``exact_prefix`` is the server's default for a body that
    does not set its own. ``agent``, ``at_end`` and ``deadline`` are the request's own
    (:class:`Request`): made here, the prompt is copied and checked once.
    """
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, (n_cells - len(prompt)) // body.n))
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "stop: up to 4 non-empty strings", param="stop")
    sampling = SamplingParams(
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
        seed=(secrets.randbelow(MAX_SEED + 1) if body.seed is None else body.seed),
        repeat_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, penalty_last_n=max_tokens,
        grammar=grammar if grammar is not None else grammar_of(body.response_format),
        logit_bias=logit_bias_pairs(body.logit_bias, n_vocab))
    params = GenerationParams(max_tokens=max_tokens, stop=tuple(stops), sampling=sampling, ignore_eos=body.ignore_eos)
    exact = exact_prefix if body.exact_prefix is None else body.exact_prefix
    return Request(prompt, params, n=body.n, stop_token_ids=frozenset(body.stop_token_ids), logprobs=logprobs,
                   exact=exact, agent=agent, at_end=at_end, deadline=deadline)
