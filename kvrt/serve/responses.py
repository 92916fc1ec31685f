"""OpenAI's Responses API on kvrt's chat path (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``).

A Responses body is translated into the chat completions body it means (``input`` items to
messages, function tools to chat tools, ``max_output_tokens`` to ``max_tokens``) and served by
the chat path (templates, tools, grammars); the chat answer is written back as a ``response``:
a ``message`` item with its ``output_text``, then a ``function_call`` item per call.

Chains: a stored response (``store``, the default) keeps its conversation, its input turns
then its output turn, and the exact tokens of its turn (its prompt's, then the ones generated);
a request naming it as ``previous_response_id`` continues that conversation from those tokens,
whose cells the engine still holds as a cached prefix: only what is new (the template's end of
turn and the new input) is prefilled (:mod:`kvrt.serve.response_chain`).
``instructions`` belong to their own request only (OpenAI's rule: they are not carried on).
``text.format`` (``json_object``, ``json_schema``) is chat's ``response_format``; a stream is
written by :mod:`kvrt.serve.responses_stream`. Not served, each a 400 naming it: built-in tools
(web search, ...), item references.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrt.serve.api_error import ApiError
from kvrt.serve.response_chain import ExactTurn

# fields of a Responses body that are the chat body's under another name, or the same
_RENAMED = {"max_output_tokens": "max_tokens"}
_SHARED = ("model", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p", "stop", "exact_prefix")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: its model, its conversation (chat messages, output turn last), the object itself and
    its turn's exact tokens (``None``: its chain renders it again; see :mod:`kvrt.serve.response_chain`)."""

    model: str
    conversation: list[dict[str, Any]]
    response: dict[str, Any]
    turn: ExactTurn | None


def chat_request(raw: Mapping[str, Any], earlier: StoredResponse | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat completions body that Responses body ``raw`` asks for, and the conversation it continues
    (``earlier``'s, then this request's input; without the instructions)."""
    if earlier is not None and raw.get("model") != earlier.model:
        raise ApiError(400, f"model: the previous response was made by {earlier.model!r}", param="model")
    conversation = [*(earlier.conversation if earlier else []), *_messages(raw.get("input"))]
    instructions = raw.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions: must be a string", param="instructions")
    chat: dict[str, Any] = {name: raw[name] for name in _SHARED if name in raw}
    chat |= {new: raw[old] for old, new in _RENAMED.items() if raw.get(old) is not None}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    if raw.get("tools"):
        chat["tools"] = _tools(raw["tools"])
    if raw.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(raw["tool_choice"])
    text = raw.get("text")
    if isinstance(text, Mapping) and isinstance(text.get("format"), Mapping) and text["format"].get("type") != "text":
        chat["response_format"] = _response_format(text["format"])
    return chat, conversation


def _messages(given: Any) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input``: a text (one user turn) or items (messages, function calls and
    their outputs; consecutive calls become one assistant turn)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "input: a text or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise ApiError(400, f"{where}: an item is an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ApiError(400, f"{where}.role: one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _string(item, "output", where)})
        else:
            raise ApiError(400, f"{where}.type: {kind!r} items are not served (message, function_call and "
                                "function_call_output are)", param=f"{where}.type", code="unsupported_parameter")
    return messages


def _string(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{name}: a string is required", param=f"{where}.{name}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or the text of its text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") in _TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}: a string or a list of text parts ({', '.join(_TEXT_PARTS)})", param=where)


def _tools(tools: Any) -> list[Any]:
    """Chat tools of Responses function tools (``{"type": "function", "name", "parameters", ...}``)."""
    if not isinstance(tools, list):
        raise ApiError(400, "tools: a list of function tools", param="tools")
    out: list[Any] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise ApiError(400, f"tools[{i}].type: only function tools are served, got {kind!r}",
                           param=f"tools[{i}].type", code="unsupported_parameter")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _response_format(fmt: Mapping[str, Any]) -> dict[str, Any]:
    """Chat's ``response_format`` for a Responses ``text.format`` (whose schema fields sit at its top level)."""
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return dict(fmt)


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def output_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as Responses output items: a ``message`` with its text, then each call."""
    items = [message_item(message["content"])] if message["content"] else []
    return items + [call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
                    for call in message.get("tool_calls") or []]


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the conversation's next (assistant) message; an empty answer is still a turn."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})


def response_object(raw: Mapping[str, Any], response_id: str, created: int, output: list[dict[str, Any]], *,
                    finish_reason: str | None, usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``response`` for request ``raw`` with ``output`` items: in progress while ``finish_reason`` is None,
    then completed, or incomplete when cut by its token limit; ``usage`` is the chat answer's."""
    status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
    return {
        "id": response_id, "object": "response", "created_at": created, "model": raw.get("model"),
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None, "output": output,
        "instructions": raw.get("instructions"), "previous_response_id": raw.get("previous_response_id"),
        "store": raw.get("store", True), "tools": raw.get("tools") or [], "tool_choice": raw.get("tool_choice", "auto"),
        "parallel_tool_calls": raw.get("parallel_tool_calls", True), "temperature": raw.get("temperature", 1.0),
        "top_p": raw.get("top_p", 1.0), "max_output_tokens": raw.get("max_output_tokens"),
        "text": raw.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
        "metadata": raw.get("metadata") or {},
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }
