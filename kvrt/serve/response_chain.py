"""The prompt of a ``/v1/responses`` request that continues a stored response: the earlier turn's exact
tokens, then only what is new.

A stored response keeps its turn as the model read and wrote it (:class:`ExactTurn`): the chat
body it answered, its answer as a chat message, and its prompt ids followed by the ids the model
generated. The engine cached those cells when the answer ended. A request naming the response as
``previous_response_id`` is rendered whole by the chat template; when that text begins with the
earlier conversation rendered with its answer (no generation prompt), and that rendering ends with
the text the template puts after an assistant message (its end of turn, found by rendering a
probe answer), the prompt is the exact tokens followed by the tokens of the rest of the text: the
end of turn and the new items. Nothing earlier is prefilled again, even where the answer's text
tokenizes to other ids than the model generated (which re-rendering it would prefill again, and
everything after it).

Otherwise the whole rendering is tokenized, as for any chat request, and a debug line on
``kvrt.serve.http`` says why: other instructions or tools than the earlier request's, a template
that writes the history differently once it goes on, or an earlier answer whose text is not all of
its tokens (a stop string cut it; :data:`WHOLE`).

The end of turn and the new items are tokenized alone: a SentencePiece vocabulary that adds a space
prefix writes one before them where they do not begin with a special token (the end-of-turn markers
of the common templates, ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, are special tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrt.engine.model import Model
from kvrt.runtime.requests import ChoiceResult
from kvrt.serve.api_error import ApiError
from kvrt.serve.chat_prompt import chat_text, tools_of
from kvrt.serve.openai_schema import ChatBody, parse, text_tokens

WHOLE = ("eog", "length", "deadline")  # the finishes whose text is all the choice's tokens (a stop string cuts it)
_PROBE = "kvrt-end-of-turn-probe"  # an answer whose rendering shows what the template writes after one
log = logging.getLogger("kvrt.serve.http")


@dataclass(frozen=True)
class ExactTurn:
    """One stored response's turn: ``chat`` (the chat body it answered, instructions and tools included),
    ``answer`` (its output as the next assistant message), ``tokens`` (its prompt ids then the generated ids)."""

    chat: dict[str, Any]
    answer: dict[str, Any]
    tokens: tuple[int, ...]

    @classmethod
    def of(cls, chat: dict[str, Any], answer: dict[str, Any], prompt: Sequence[int],
           choice: ChoiceResult) -> ExactTurn | None:
        """The turn of a finished choice; ``None`` where its text is not all of its tokens (see :data:`WHOLE`)."""
        if choice.finish_reason not in WHOLE:
            log.debug("a stored response ended %r: its chain will render its answer again", choice.finish_reason)
            return None
        return cls(chat, answer, (*prompt, *choice.tokens))


def continued_prompt(model: Model, body: ChatBody, earlier: ExactTurn, *,
                     limit: tuple[int, int] | None) -> list[int]:
    """Tokens of chat ``body``, which continues ``earlier``'s conversation: ``earlier.tokens`` then the rest of
    the rendering, or the whole rendering's tokens where it does not continue the earlier one (see the module)."""
    text, add_special = chat_text(model, body.messages, tools=tools_of(body))
    rest = _after_answer(model, text, earlier)
    if rest is None:
        return text_tokens(model, text, limit=limit, param="messages", add_special=add_special)
    return [*earlier.tokens, *text_tokens(model, rest, limit=limit, param="messages", add_special=False,
                                          held=len(earlier.tokens))]


def _after_answer(model: Model, text: str, earlier: ExactTurn) -> str | None:
    """What ``text`` holds after ``earlier``'s answer (the template's end of turn, then the new items); ``None``
    where it does not continue the earlier conversation as rendered."""
    try:
        before = _rendered(model, earlier, earlier.answer)
        probe = _rendered(model, earlier, {"role": "assistant", "content": _PROBE})
    except ApiError as exc:
        log.debug("previous_response_id: the earlier conversation does not render with its answer (%s); rendering "
                  "it again", exc)
        return None
    at = probe.rfind(_PROBE)
    end = probe[at + len(_PROBE):] if at >= 0 else None
    if end is None or not before.endswith(end):
        log.debug("previous_response_id: the template ends an assistant message other than it ends this answer; "
                  "rendering the conversation again")
        return None
    if not text.startswith(before):
        log.debug("previous_response_id: the earlier conversation as rendered does not begin this one (other "
                  "instructions or tools?); rendering it again")
        return None
    return text[len(before) - len(end):]


def _rendered(model: Model, earlier: ExactTurn, answer: dict[str, Any]) -> str:
    """``earlier``'s conversation, ``answer`` last, as its request's template and tools render it."""
    body = parse(ChatBody, {**earlier.chat, "messages": [*earlier.chat["messages"], answer]})
    return chat_text(model, body.messages, tools=tools_of(body), generation=False)[0]
