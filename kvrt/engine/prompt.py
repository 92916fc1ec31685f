"""A prompt as token ids: text tokenized by its model, or token ids checked against the model's vocabulary.

Every entry point that takes a prompt (one generation, fan-out, pipelines, the agent
services) turns it into tokens here, so they refuse the same things the same way.
"""

from __future__ import annotations

from kvrt.checks import check_text, check_tokens, shown
from kvrt.engine.model import Model
from kvrt.errors import InvalidArgument, KvrtError


def prompt_tokens(model: Model, prompt: object, what: str, *, add_special: bool,
                  error: type[KvrtError] = InvalidArgument) -> list[int]:
    """The token ids of ``prompt``: text (tokenized, BOS per ``add_special``) or token ids; never empty.

    Bytes are refused as text (they are not token ids, though they iterate as ints).
    """
    if isinstance(prompt, (str, bytes, bytearray, memoryview)):
        tokens = model.tokenize(check_text(prompt, what, error=error), add_special=add_special)
        if not tokens:
            raise error(f"{what} {shown(prompt)} has no tokens")
        return tokens
    return check_tokens(prompt, what, model.n_vocab, expected="text (str) or a sequence of token ids", error=error)
