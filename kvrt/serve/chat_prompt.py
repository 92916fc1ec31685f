"""A chat request's prompt tokens and its tool plan (which calls to parse, and the grammar that forces them).

Rendering: plain role/content turns go through llama.cpp's built-in template matcher
(:func:`kvrt.engine.chat.apply_chat_template`), as before tools existed. A request with
``tools``, or a history with assistant ``tool_calls`` or ``tool`` messages, is rendered by the
GGUF's own Jinja template in a sandbox (:mod:`kvrt.engine.chat_jinja`), which knows how its
model was taught to call tools. A model without a Jinja template gets kvrt's fallback: the
tools described in the system message, calls and results written as Hermes ``<tool_call>``
/ ``<tool_response>`` text, rendered by the built-in matcher.

The history is checked first (each a 400 naming the field): ``tool_calls`` only on assistant
messages, a ``tool`` message answers (``tool_call_id``) a call of the assistant message
before it, content is given unless an assistant message carries calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrt.engine.chat import ChatTemplateError, apply_chat_template
from kvrt.engine.chat_jinja import jinja_template, render_jinja
from kvrt.engine.model import Model
from kvrt.serve.api_error import ApiError
from kvrt.serve.openai_schema import ChatBody, ChatMessageBody, text_tokens
from kvrt.serve.tool_calls import call_grammar, tool_format

FALLBACK_TOOLS = ("You may call functions to help with the user's request. Their signatures (JSON schemas) are "
                  "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\nTo call one, answer with its name and "
                  "arguments as a JSON object inside <tool_call></tool_call> tags, one block per call:\n"
                  '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's output is read for: calls of the tools ``names``; ``grammar`` (``required`` or a
    named ``tool_choice``) constrains the output to calls, else it is free text parsed afterwards.

    A forced choice's grammar replaces ``response_format``'s, as with OpenAI (the output is calls, and a text
    format governs text); unforced, ``response_format`` constrains the whole output, so no call comes then.
    """

    names: frozenset[str]
    grammar: str | None


def tool_plan(body: ChatBody, model: Model) -> ToolPlan | None:
    """The request's :class:`ToolPlan`; ``None`` when its output is plain text (no tools, or ``tool_choice``
    ``none``). Every tool's schema is converted to a grammar whatever the choice, so a bad one is always a 400."""
    if body.tool_choice is not None and not body.tools:
        raise ApiError(400, "tool_choice: given without tools (send the tools it chooses among)",
                       param="tool_choice")
    if not body.tools:
        return None
    names: list[str] = []
    for i, tool in enumerate(body.tools):
        if tool.function.name in names:
            raise ApiError(400, f"tools[{i}].function.name: {tool.function.name!r} is defined twice",
                           param=f"tools[{i}].function.name")
        names.append(tool.function.name)
    choice = body.tool_choice or "auto"
    only = None if isinstance(choice, str) else choice.function.name
    if only is not None and only not in names:
        raise ApiError(400, f"tool_choice.function.name: no tool is named {only!r}; the tools are {names}",
                       param="tool_choice.function.name", code="unknown_tool")
    forced = choice == "required" or only is not None
    grammar = call_grammar(_tools(body), tool_format(jinja_template(model)), only=only,
                           parallel=body.parallel_tool_calls)
    return None if choice == "none" else ToolPlan(frozenset(names), grammar if forced else None)


def chat_prompt(model: Model, messages: Sequence[ChatMessageBody], *, tools: list[dict[str, Any]] | None = None,
                generation: bool = True, limit: tuple[int, int] | None = None) -> list[int]:
    """Tokens of ``messages`` (and ``tools``, which the model is told of) rendered by the model's chat template
    (special-token text parsed); ``limit``: see :func:`kvrt.serve.openai_schema.text_tokens`."""
    text, add_special = chat_text(model, messages, tools=tools, generation=generation)
    return text_tokens(model, text, limit=limit, param="messages", add_special=add_special)


def chat_text(model: Model, messages: Sequence[ChatMessageBody], *, tools: list[dict[str, Any]] | None = None,
              generation: bool = True) -> tuple[str, bool]:
    """``messages`` (and ``tools``) rendered by the model's chat template, and whether the tokenizer is to add its
    special tokens (not when a Jinja template wrote the BOS itself: it must not get a second one)."""
    turns = _turns(messages)
    with_tools = tools is not None or any("tool_calls" in t or t["role"] == "tool" for t in turns)
    source = jinja_template(model) if with_tools else None
    try:
        if source is not None:
            bos = model.special_text("bos")
            text = render_jinja(source, turns, tools=tools, add_generation_prompt=generation, bos_token=bos,
                                eos_token=model.special_text("eos"))
            return text, not (bool(bos) and text.startswith(bos))
        plain = _fallback_turns(turns, tools) if with_tools else turns
        return apply_chat_template(model, plain, add_generation_prompt=generation), True
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def tools_of(body: ChatBody) -> list[dict[str, Any]] | None:
    """The tools the template is told of: none with ``tool_choice`` ``none`` (the model is not to call them)."""
    return None if not body.tools or body.tool_choice == "none" else _tools(body)


def _tools(body: ChatBody) -> list[dict[str, Any]]:
    return [tool.model_dump(exclude_none=True) for tool in body.tools or []]


def _turns(messages: Sequence[ChatMessageBody]) -> list[dict[str, Any]]:
    """The messages as the dicts templates read, checked; calls' arguments as objects (what templates expect)."""
    turns: list[dict[str, Any]] = []
    calls: set[str] = set()  # ids of the calls the latest assistant message made
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        content = message.content
        if isinstance(content, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                raise ApiError(400, f"{where}.content: only text parts are supported", param=f"{where}.content")
            content = "".join(part["text"] for part in content)
        turn: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls is not None:
            if message.role != "assistant":
                raise ApiError(400, f"{where}.tool_calls: only assistant messages carry tool calls (this one is "
                                    f"{message.role!r})", param=f"{where}.tool_calls")
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in message.tool_calls]
            calls = {c.id for c in message.tool_calls}
        elif content is None:
            raise ApiError(400, f"{where}.content is required", param=f"{where}.content")
        if message.role == "tool":
            if message.tool_call_id is None:
                raise ApiError(400, f"{where}.tool_call_id is required: a tool message answers a call",
                               param=f"{where}.tool_call_id")
            if message.tool_call_id not in calls:
                raise ApiError(400, f"{where}.tool_call_id: {message.tool_call_id!r} is not a call of the assistant "
                                    f"message before it (its calls: {sorted(calls)})", param=f"{where}.tool_call_id")
            turn["tool_call_id"] = message.tool_call_id
        elif message.role != "assistant" or message.tool_calls is None:
            calls = set()
        if message.name is not None:
            turn["name"] = message.name
        turns.append(turn)
    return turns


def _fallback_turns(turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Role/content turns for a model without a Jinja template: the tools in the system message, calls and
    results as Hermes text (results as user turns: built-in templates know no ``tool`` role)."""
    plain: list[dict[str, str]] = []
    for turn in turns:
        content = turn["content"]
        for call in turn.get("tool_calls", []):
            block = json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            content += f"\n<tool_call>\n{block}\n</tool_call>"
        if turn["role"] == "tool":
            plain.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            plain.append({"role": turn["role"], "content": content.strip() if "tool_calls" in turn else content})
    if tools:
        described = FALLBACK_TOOLS.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
        if plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{described}"}
        else:
            plain.insert(0, {"role": "system", "content": described})
    return plain
