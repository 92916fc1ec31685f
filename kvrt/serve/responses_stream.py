"""A streamed ``/v1/responses`` answer: OpenAI's ``response.*`` events, written from the chat stream's chunks.

The chat path streams ``chat.completion.chunk`` objects (:class:`kvrt.serve.openai_format.Shaper`,
text held back while it may be a tool call); :class:`ResponseEvents` turns each into the
events it means, in OpenAI's order: ``response.created`` and ``response.in_progress``; a
``message`` item around the text (``output_item.added``, ``content_part.added``,
``output_text.delta``..., ``output_text.done``, ``content_part.done``, ``output_item.done``);
a ``function_call`` item per call (``output_item.added``, ``function_call_arguments.delta``
/ ``.done``, ``output_item.done``); last ``response.completed`` (``response.incomplete`` when
cut by ``max_output_tokens``) with the whole response, whose items are the ones streamed
(same ids). A failed request ends with an ``error`` event. Every event has its
``sequence_number`` and is sent with its type as the SSE ``event:``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvrt.serve.responses import call_item, message_item, response_object
from kvrt.serve.sse import sse


class ResponseEvents:
    """The events of one streamed response (``raw``: its Responses body); :attr:`response` is the finished
    response once the stream's usage chunk came."""

    def __init__(self, raw: Mapping[str, Any], response_id: str, created: int) -> None:
        self._raw, self._id, self._created = raw, response_id, created
        self.output: list[dict[str, Any]] = []
        self.response: dict[str, Any] | None = None
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._finish: str | None = None

    def opening(self) -> list[str]:
        started = self._response(None)
        return [self._event("response.created", response=started), self._event("response.in_progress",
                                                                                 response=started)]

    def feed(self, chunk: Mapping[str, Any]) -> list[str]:
        """The events one chat chunk (or the stream's error body) makes."""
        if "error" in chunk:
            error = chunk["error"]
            return [self._event("error", code=error["code"], message=error["message"], param=error["param"])]
        if "usage" in chunk:  # the last chunk: the answer is whole
            self.response = self._response(chunk["usage"])
            kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
            return [self._event(kind, response=self.response)]
        choice = chunk["choices"][0]
        delta, out = choice["delta"], []
        if delta.get("content"):
            out += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        if choice["finish_reason"]:
            out += self._close()
            self._finish = choice["finish_reason"]
        return out

    def _text(self, text: str) -> list[str]:
        out = []
        if self._open is None or self._open["type"] != "message":
            out += self._close() + self._add(message_item("", "in_progress"))
            out.append(self._event("response.content_part.added", **self._where(), part=self._part("")))
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        return out + [self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])]

    def _call(self, delta: Mapping[str, Any]) -> list[str]:
        """A chat tool-call delta: the opening one (id and name) starts an item, the next one carries arguments."""
        if "id" in delta:
            return self._close() + self._add(call_item(delta["id"], delta["function"]["name"], "", "in_progress"))
        assert self._open is not None and self._open["type"] == "function_call"
        self._open["arguments"] += delta["function"]["arguments"]
        return [self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                            output_index=len(self.output) - 1, delta=delta["function"]["arguments"])]

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def _close(self) -> list[str]:
        """The events that end the open item (none when none is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        out, index = [], len(self.output) - 1
        if item["type"] == "message":
            text = item["content"][0]["text"]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out += [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                    self._event("response.content_part.done", **where, part=self._part(text))]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        return out + [self._event("response.output_item.done", output_index=index, item=item)]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1, "content_index": 0}

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def _response(self, usage: Mapping[str, Any] | None) -> dict[str, Any]:
        return response_object(self._raw, self._id, self._created, list(self.output),
                               finish_reason=self._finish if usage is not None else None, usage=usage)

    def _event(self, kind: str, **fields: Any) -> str:
        self._sequence += 1
        return sse({"type": kind, "sequence_number": self._sequence - 1, **fields}, event=kind)
