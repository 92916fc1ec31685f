"""Engine events shaped as OpenAI response objects: whole responses and streaming chunks.

One :class:`Shaper` per HTTP request, for the chat endpoint (``chat.completion`` and
``chat.completion.chunk``, logprobs as ``content`` entries) or the text one
(``text_completion``, logprobs as the legacy parallel lists). Engine finish reasons map
to OpenAI's: end-of-generation and stops are ``stop``, ``length`` stays; a request cut
by the server's deadline says ``deadline`` (not an OpenAI value). With ``tokens`` (the
``return_tokens`` extension, text completions) every choice and chunk also carries the
token ids it holds as ``tokens``, as llama.cpp's server does.

With ``tools`` (a chat request's tool names) each choice's text is read for tool calls
(:mod:`kvrt.serve.tool_calls`): found, they become the message's ``tool_calls`` (its content
what came before them, or null) and the finish reason ``tool_calls``. Streamed, text passes on
as it comes until a call may have begun and is held from there; at the choice's end each
call is sent in OpenAI's delta shape: its index, id, type and name with empty arguments,
then its arguments.
"""

from __future__ import annotations

from typing import Any, Literal

from kvrt.engine.model import Model
from kvrt.runtime.requests import ChoiceEnd, ChoiceResult, RequestEnd, RequestResult, TokenEvent, TokenLogprob
from kvrt.serve.tool_calls import CallSplitter, ToolCall, parse_calls

FINISH = {"tool_calls": "tool_calls", "eog": "stop", "stop": "stop", "length": "length", "cancelled": "stop",
          "deadline": "deadline"}
Kind = Literal["chat", "text"]


class Shaper:
    """OpenAI objects for one request: ``kind`` chat or text, ``logprobs`` whether to include them."""

    def __init__(self, kind: Kind, request_id: str, created: int, model_name: str, model: Model, n: int,
                 logprobs: bool, tokens: bool = False, tools: frozenset[str] | None = None) -> None:
        self.kind, self.id, self.created, self.model_name = kind, request_id, created, model_name
        self.model, self.n, self.logprobs, self.tokens, self.tools = model, n, logprobs, tokens, tools
        self._offsets = [0] * n  # text completions: characters before each choice's next token
        self._splitters = [CallSplitter(tools) for _ in range(n)] if tools is not None else None

    # -- pieces -----------------------------------------------------------------------
    def _piece(self, token: int) -> tuple[str, list[int]]:
        raw = self.model.token_to_piece(token)
        return raw.decode("utf-8", "replace"), list(raw)

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        text, raw = self._piece(lp.token)
        top = []
        for token, value in lp.top:
            t_text, t_raw = self._piece(token)
            top.append({"token": t_text, "logprob": value, "bytes": t_raw})
        return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}

    def _text_logprobs(self, index: int, lps: list[TokenLogprob]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            text, _ = self._piece(lp.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self._piece(t)[0]: v for t, v in lp.top})
            out["text_offset"].append(self._offsets[index])
            self._offsets[index] += len(text)
        return out

    def _logprobs(self, index: int, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_logprob(lp) for lp in lps], "refusal": None}
        return self._text_logprobs(index, lps)

    def usage(self, end: RequestEnd) -> dict[str, Any]:
        return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
                "total_tokens": end.prompt_tokens + end.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": end.cached_tokens}}

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name,
                "system_fingerprint": None, "choices": choices}

    # -- streaming ----------------------------------------------------------------------
    def role_chunk(self) -> dict[str, Any] | None:
        """The chat stream's opening chunk (every choice's role); ``None`` for text completions."""
        if self.kind != "chat":
            return None
        return self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(self.n)], chunk=True)

    def chunk(self, index: int, text: str, logprob: TokenLogprob | None = None,
              finish_reason: str | None = None, token: int | None = None) -> dict[str, Any]:
        """A streaming chunk carrying ``text`` (and a token's logprobs and id) or a choice's finish."""
        reason = FINISH.get(finish_reason, finish_reason) if finish_reason else None
        lps = self._logprobs(index, [logprob]) if logprob is not None else None
        if self.kind == "chat":
            delta = {"content": text} if text or logprob is not None else {}
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": reason}
            if self.tokens:
                choice["tokens"] = [] if token is None else [token]
        return self._envelope([choice], chunk=True)

    def token_chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        """The chunks one token's event makes (none when it adds no text, logprob or token id, or its text is
        held as a possible tool call)."""
        text = event.text if self._splitters is None else self._splitters[event.index].feed(event.text)
        if text or event.logprob is not None or self.tokens:
            return [self.chunk(event.index, text, event.logprob, token=event.token)]
        return []

    def end_chunks(self, event: ChoiceEnd) -> list[dict[str, Any]]:
        """A choice's last chunks: the text it still held, its tool calls, its finish reason."""
        text, reason = event.rest, event.finish_reason
        calls: list[ToolCall] = []
        if self._splitters is not None:
            held = self._splitters[event.index].feed(event.rest)
            rest, calls = self._splitters[event.index].finish()
            text, reason = held + rest, "tool_calls" if calls else reason
        out = [self.chunk(event.index, text)] if text else []
        for k, call in enumerate(calls):
            opening = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            for delta in (opening, {"index": k, "function": {"arguments": call.arguments}}):
                out.append(self._envelope([{"index": event.index, "delta": {"tool_calls": [delta]}, "logprobs": None,
                                            "finish_reason": None}], chunk=True))
        return out + [self.chunk(event.index, "", finish_reason=reason)]

    def usage_chunk(self, end: RequestEnd) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": self.usage(end)}

    # -- whole responses ------------------------------------------------------------------
    def response(self, result: RequestResult) -> dict[str, Any]:
        choices = [self._choice(i, c) for i, c in enumerate(result.choices)]
        return {**self._envelope(choices, chunk=False), "usage": self.usage(result.end)}

    def _choice(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        reason = FINISH.get(choice.finish_reason or "length", choice.finish_reason)
        lps = self._logprobs(index, choice.logprobs)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
            parsed = parse_calls(choice.text, self.tools) if self.tools is not None else None
            if parsed is not None:
                content, calls = parsed
                message |= {"content": content if content.strip() else None,
                            "tool_calls": [call.openai() for call in calls]}
                reason = "tool_calls"
            return {"index": index, "message": message, "logprobs": lps, "finish_reason": reason}
        out = {"index": index, "text": choice.text, "logprobs": lps, "finish_reason": reason}
        return out | {"tokens": list(choice.tokens)} if self.tokens else out
