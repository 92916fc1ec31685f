"""A GGUF's Jinja chat template (``tokenizer.chat_template``) run in a sandbox.

llama.cpp's built-in matcher (:mod:`kvrt.engine.chat`) renders plain role/content turns of
the template families it recognises; tools, assistant tool calls and tool results need the
template itself run. This runs it as Hugging Face transformers and llama-cpp-python's
``Jinja2ChatFormatter`` do: jinja2's ``ImmutableSandboxedEnvironment`` (a template reaches no
Python internals and cannot mutate what it is given), ``trim_blocks`` and ``lstrip_blocks``,
``raise_exception(message)``, ``tojson`` as plain ``json.dumps`` (transformers' filter: no
HTML escaping, which would turn ``<`` into ``\\u003c`` inside tool schemas) and
``strftime_now(format)``. Any template error is a :class:`ChatTemplateError`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

from kvrt.engine.chat import ChatTemplateError, chat_template
from kvrt.engine.model import Model

if TYPE_CHECKING:
    import jinja2


def jinja_template(model: Model) -> str | None:
    """The model's default chat template when it is Jinja source; ``None`` when it has none, or only a family
    name that llama.cpp's matcher knows."""
    source = chat_template(model)
    return source if source is not None and ("{%" in source or "{{" in source) else None


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    """``source`` compiled once (a server renders the same few templates for every request)."""
    from jinja2 import BaseLoader, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(loader=BaseLoader(), trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None


def render_jinja(source: str, messages: Sequence[Mapping[str, Any]], *,
                 tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                 bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text ``source`` renders for ``messages`` (OpenAI-shaped dicts: ``role``, ``content``,
    ``tool_calls``, ``tool_call_id``, ...) and ``tools`` (OpenAI's ``{"type": "function", "function": ...}``
    entries; ``None``: the template is told of none)."""
    template = _compiled(source)
    try:
        return template.render(messages=list(messages), tools=None if tools is None else list(tools),
                               add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                               eos_token=eos_token)
    except ChatTemplateError:
        raise
    except Exception as exc:  # TemplateError (the sandbox's SecurityError included) or whatever the template's
        # own Python operations raised on these messages (TypeError, KeyError, ...): the request's to mend
        raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from None
