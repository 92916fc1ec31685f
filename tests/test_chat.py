"""Chat templates through llama.cpp's own template function, checked against the formats' published markers."""

from __future__ import annotations

import pytest

from kvrt.engine.chat import ChatMessage, ChatTemplateError, apply_chat_template, chat_template
from kvrt.engine.model import Model

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_demo_model_renders_gemma_turns(demo_model: Model) -> None:
    assert chat_template(demo_model) == "gemma"  # the GGUF ships none: its architecture's family
    prompt = apply_chat_template(demo_model, CHAT)
    # Gemma folds the system prompt into the first user turn and opens the model's turn
    assert prompt == "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    closed = apply_chat_template(demo_model, CHAT, add_generation_prompt=False)
    assert closed == "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"


def test_named_template_and_message_objects(tiny_model: Model) -> None:
    messages = [ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello"), ChatMessage("user", "Ünï ✓")]
    prompt = apply_chat_template(tiny_model, messages, template="chatml")
    assert prompt == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
                      "<|im_start|>user\nÜnï ✓<|im_end|>\n<|im_start|>assistant\n")


def test_long_conversations_grow_the_buffer(tiny_model: Model) -> None:
    text = "word " * 5000
    prompt = apply_chat_template(tiny_model, [{"role": "user", "content": text}], template="chatml")
    assert text in prompt


def test_a_model_without_a_template_is_refused(tiny_model: Model) -> None:
    assert chat_template(tiny_model) is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        apply_chat_template(tiny_model, CHAT)


@pytest.mark.parametrize(("messages", "match"), [
    ([], "at least one message"),
    ("hello", "list of chat messages"),
    ([{"role": "user"}], "message 0"),
    ([{"role": "user", "content": None}], "content must be a string"),
    ([{"role": "", "content": "x"}], "role must not be empty"),
    ([{"role": "user", "content": "a\x00b"}], "NUL"),
])
def test_malformed_messages_are_refused(tiny_model: Model, messages: object, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        apply_chat_template(tiny_model, messages, template="chatml")  # type: ignore[arg-type]


def test_an_unknown_template_is_refused(tiny_model: Model) -> None:
    with pytest.raises(ChatTemplateError, match="does not recognise"):
        apply_chat_template(tiny_model, CHAT, template="{% not a known template %}")
