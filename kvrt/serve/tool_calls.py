"""Tool calls in a model's output: the format a chat template asks for, the grammar that forces it, the parser.

Formats (what a template's text shows the model; :func:`tool_format` picks one):

``hermes``  (Hermes, Qwen 2/2.5/3, kvrt's fallback) ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
            one block per call;
``mistral`` ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
``llama3``  (Llama 3.1-3.3) ``{"name": ..., "parameters": {...}}``, calls separated by ``;``, maybe after
            ``<|python_tag|>``;
``json``    a bare ``{"name": ..., "arguments": {...}}`` object, or an array of them.

The parser does not trust the format it asked for (small models mix them): after the first
call marker (or at a leading ``{`` / ``[``) the rest must be JSON values, separated only by
whitespace, ``;``, ``,`` and the markers, each a call (or a list of calls) naming a tool of the
request with object arguments. Anything else is not a tool call and stays the message's text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvrt.serve.json_grammar import GrammarBuilder

ToolFormat = Literal["hermes", "mistral", "llama3", "json"]
MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")  # a call starts here (text before it is content)
_SEPARATORS = (*MARKERS, "</tool_call>", ";", ",")
_ARGUMENT_KEYS = {"hermes": "arguments", "mistral": "arguments", "llama3": "parameters", "json": "arguments"}


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from the output: OpenAI's ``id``, the function's ``name``, ``arguments`` as JSON text."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_format(template: str | None) -> ToolFormat:
    """The call format a Jinja chat template teaches its model (``hermes`` where there is no template: kvrt's
    fallback prompt teaches that one)."""
    if template is None or "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3"
    return "json"


def call_grammar(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, *, only: str | None, parallel: bool) -> str:
    """GBNF for output that is nothing but calls in ``fmt``: of the tool named ``only`` (else of any of ``tools``),
    one, or (``parallel``) one or more, each call's arguments fitting its tool's parameter schema.

    Every tool's schema is converted, so a schema that cannot be is refused (400 naming
    ``tools[i].function.parameters``) whichever tool the choice names.
    """
    builder = GrammarBuilder()
    name_key, arguments_key = (builder.literal(json.dumps(k)) for k in ("name", _ARGUMENT_KEYS[fmt]))
    calls = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        arguments = builder.add(schema, f"tool-{i}-arguments", param=f"tools[{i}].function.parameters")
        rule = builder.rule(f"tool-{i}-call", f'"{{" space {name_key} space ":" space '
                                              f'{builder.literal(json.dumps(function["name"]))} space "," space '
                                              f'{arguments_key} space ":" space {arguments} "}}" space')
        if only is None or function["name"] == only:
            calls.append(rule)
    call = builder.rule("tool-call", " | ".join(calls))
    if fmt == "hermes":
        block = f'"<tool_call>\\n" {call} "\\n</tool_call>"'
        root = f'{block} ("\\n" {block})*' if parallel else block
    elif fmt == "mistral":
        root = f'"[TOOL_CALLS][" {call} ("," space {call})* "]"' if parallel else f'"[TOOL_CALLS][" {call} "]"'
    elif fmt == "llama3":
        root = f'{call} (";" space {call})*' if parallel else call
    else:
        root = f'"[" space {call} ("," space {call})* "]" space' if parallel else call
    builder.rule("root", root)
    return builder.text()


def parse_calls(text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]] | None:
    """``(content before the calls, calls)`` when ``text`` ends in well-formed calls of tools in ``names``;
    ``None`` when it holds none (it is all content then)."""
    start = call_start(text)
    if start is None:
        return None
    # strict=False: control characters inside strings are taken (llama-cpp-python's grammar lets a model write
    # them raw); the arguments are written back as JSON with them escaped
    decoder, rest, values = json.JSONDecoder(strict=False), text[start:], []
    i = 0
    while True:
        i = _skip_separators(rest, i)
        if i == len(rest):
            break
        try:
            value, i = decoder.raw_decode(rest, i)
        except ValueError:
            return None
        values.extend(value if isinstance(value, list) else [value])
    calls = [_call(value, names) for value in values]
    if not calls or any(c is None for c in calls):
        return None
    return text[:start], [c for c in calls if c is not None]


def call_start(text: str) -> int | None:
    """Where the first call begins: the first marker, or a JSON value that opens the output."""
    marker = _marker_at(text)
    if marker is not None:
        return marker
    stripped = text.lstrip()
    return len(text) - len(stripped) if stripped[:1] in ("{", "[") else None


def _skip_separators(text: str, i: int) -> int:
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        sep = next((s for s in _SEPARATORS if text.startswith(s, i)), None)
        if sep is None:
            return i
        i += len(sep)
    return i


def _call(value: Any, names: frozenset[str]) -> ToolCall | None:
    """A call from one parsed value (``{"name", "arguments" | "parameters"}``, maybe inside ``{"function": ...}``)."""
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        value = value["function"]
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            arguments = json.loads(arguments, strict=False)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"],
                    json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


class CallSplitter:
    """One streamed choice's text: content passes on as it comes until a call may have begun, then is held.

    Invariant: what :meth:`feed` returned plus what :meth:`finish` returns as content is the
    whole text, less the calls it found. A marker split across tokens is held back until it
    is known not to be one; leading whitespace is held until it is known whether a JSON call
    follows it, and output that opens with ``{`` or ``[`` is held whole (it may be a plain JSON
    call) and passed on at the end if it is not one.
    """

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names
        self._pending = ""  # text not yet passed on: a possible marker's start, or everything once a call began
        self._holding = False
        self._started = False  # some non-whitespace content was passed on (a leading "{" no longer starts a call)

    def feed(self, text: str) -> str:
        """The content that can be passed on now, ``text`` included."""
        self._pending += text
        if self._holding:
            return ""
        start = call_start(self._pending) if not self._started else _marker_at(self._pending)
        if start is not None:
            out, self._pending, self._holding = self._pending[:start], self._pending[start:], True
            return out
        keep = _partial_marker(self._pending)
        if not self._started and not self._pending[:len(self._pending) - keep].strip():
            return ""  # whitespace so far: a call may still open the output
        out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        self._started = self._started or bool(out.strip())
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not yet passed on and the calls found (none: what was held is content after all)."""
        pending, self._pending = self._pending, ""
        parsed = parse_calls(pending, self._names) if self._holding else None
        return (pending, []) if parsed is None else parsed


def _marker_at(text: str) -> int | None:
    found = [i for i in (text.find(m) for m in MARKERS) if i >= 0]
    return min(found) if found else None


def _partial_marker(text: str) -> int:
    """Length of the longest end of ``text`` that begins a marker (it must wait for the next token)."""
    return max((n for m in MARKERS for n in range(1, len(m)) if text.endswith(m[:n])), default=0)
