"""Chat messages rendered into a prompt with the model's own template (llama.cpp's template function).

The template comes from the GGUF's ``tokenizer.chat_template`` metadata; llama.cpp
recognises the common families (Gemma, Llama 3, ChatML, Mistral, ...) and renders them
without a Jinja engine. A GGUF without one falls back to its architecture's family where
that is unambiguous (Gemma's turn markers for ``gemma*``: the demo model ships none);
otherwise, and for a template llama.cpp does not recognise, a :class:`ChatTemplateError`
says so rather than guessing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvrt.bindings import ffi, lib
from kvrt.engine.model import Model
from kvrt.errors import KvrtError

_ARCHITECTURE_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma"}


class ChatTemplateError(KvrtError):
    """Messages that cannot be rendered: no template, an unknown template, or malformed messages."""


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation: ``role`` (``system``, ``user``, ``assistant``, ...) and its text."""

    role: str
    content: str

    def __post_init__(self) -> None:
        for name in ("role", "content"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ChatTemplateError(f"chat message {name} must be a string, got {type(value).__name__}")
            if "\x00" in value:
                raise ChatTemplateError(f"chat message {name} contains a NUL character")
        if not self.role:
            raise ChatTemplateError("chat message role must not be empty")


def chat_template(model: Model, name: str | None = None) -> str | None:
    """The model's chat template (the named one, or the default), its architecture's family name when the
    GGUF has none, or ``None``."""
    ptr = lib().llama_model_chat_template(model.ptr, name.encode() if name else ffi.NULL)
    if ptr != ffi.NULL:
        return str(ffi.string(ptr).decode("utf-8", "replace"))
    return None if name else _ARCHITECTURE_TEMPLATES.get(model.meta("general.architecture") or "")


def as_messages(messages: Sequence[ChatMessage | Mapping[str, str]]) -> list[ChatMessage]:
    """``ChatMessage`` objects from messages or OpenAI-style ``{"role": ..., "content": ...}`` dicts."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of chat messages, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, ChatMessage):
            out.append(message)
        elif isinstance(message, Mapping) and {"role", "content"} <= set(message):
            out.append(ChatMessage(message["role"], message["content"]))
        else:
            raise ChatTemplateError(f"message {i} is neither a ChatMessage nor a dict with role and content")
    if not out:
        raise ChatTemplateError("a chat needs at least one message")
    return out


def apply_chat_template(
    model: Model,
    messages: Sequence[ChatMessage | Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    template: str | None = None,
) -> str:
    """The prompt text for ``messages``; with ``add_generation_prompt`` it ends where the assistant speaks."""
    chat = as_messages(messages)
    source = template if template is not None else chat_template(model)
    if source is None:
        raise ChatTemplateError(f"{model.path.name} has no chat template in its metadata; pass template=")
    keep = [(ffi.new("char[]", m.role.encode()), ffi.new("char[]", m.content.encode())) for m in chat]
    c_chat = ffi.new("llama_chat_message[]", len(keep))
    for slot, (role, content) in zip(c_chat, keep, strict=True):
        slot.role, slot.content = role, content  # ``keep`` holds the strings while llama.cpp reads them
    c_template = source.encode()
    size = max(256, 2 * sum(len(m.role) + len(m.content.encode()) for m in chat))
    while True:
        buf = ffi.new("char[]", size)
        n = int(lib().llama_chat_apply_template(c_template, c_chat, len(keep), add_generation_prompt, buf, size))
        if n < 0:
            raise ChatTemplateError(f"llama.cpp does not recognise the chat template of {model.path.name} "
                                    f"(starts {source[:60]!r}); pass a known template name or text as template=")
        if n <= size:
            return bytes(ffi.buffer(buf, n)).decode("utf-8", "replace")
        size = n + 1
