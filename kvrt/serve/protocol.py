"""lmxd's line protocol, parsed strictly and answered in its ``OK …`` / ``ERR …`` form.

One request is one line: ``\\n``-terminated UTF-8 of at most :data:`MAX_LINE` bytes, the
``\\n`` included. Verbs: HELP, STATUS, LIST, REGISTER ``<agent_id> <model_path> [n_ctx]``,
UNREGISTER ``<agent_id>``, DECODE ``<agent_id> <n_tokens> <prompt…>``, and kvrt's additions
METRICS ``[agent_id]``, FORK ``<source_id> <agent_id>`` and QUIT.

Replies keep lmxd's shape (``OK key=value`` lines, ``ERR CODE …`` lines, the generated
text between ``BEGIN_RESPONSE`` and ``END_RESPONSE``) with two additions that make the
stream framable by a program as well as readable through ``nc -U``: ``BEGIN_RESPONSE``
carries ``bytes=N`` (the text may itself contain newlines), and every reply ends with
the line ``END``. In a DECODE prompt ``\\n`` stands for a newline and ``\\\\`` for a
backslash, so multi-line prompts fit on one request line.

Every malformed input becomes a :class:`ProtocolError`, whose :meth:`~ProtocolError.reply`
is an ``ERR`` line; parsing never raises anything else. :func:`error_reply` is the one
mapping from any exception a command raised to its ``ERR`` line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvrt.accounting.estimate import EstimateError
from kvrt.accounting.ledger import LedgerDenied
from kvrt.errors import ContextError, InvalidArgument, KvrtError, ModelLoadError
from kvrt.runtime.requests import EngineClosed
from kvrt.serve.results import SchedulerError
from kvrt.state.agentstore import AgentStoreError

SCHEMA = "kvrt-daemon/1"
MAX_LINE = 1 << 20  # bytes of one request line, its newline included
MAX_TOKENS = 1 << 20
MAX_CTX = 1 << 24
END = "END"
_NUMBER = re.compile(r"^[0-9]{1,12}$")
_FIELD = re.compile(r'(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=("(?:[^"\\]|\\.)*"|\S+)')

HELP_LINES = (
    "HELP                                   this text",
    "STATUS                                 ledger (re-read from the device), models, agents",
    "LIST                                   one line per agent",
    "REGISTER <agent_id> <model_path> [n_ctx] [policy=refuse|shift|grow] [min_ctx=N] [keep=N]",
    "                                       admit an agent (n_ctx default 4096; at its limit a turn is refused,",
    "                                       or its oldest tokens after keep are dropped, or it grows from min_ctx)",
    "UNREGISTER <agent_id>                  remove an agent, free its memory",
    "DECODE <agent_id> <n_tokens> <prompt…>  append the prompt, generate up to n_tokens",
    "METRICS [agent_id]                     request count and p50/p95/p99 latency",
    "FORK <source_id> <agent_id>            new agent starting from a copy of source's history",
    "CANCEL <agent_id>                      end the agent's running and queued requests (finish_reason=cancelled)",
    "DECODE options, before a lone --:      temperature= top_p= top_k= seed= stop=\"..\" deadline_ms= stream=1",
    "QUIT                                   close this connection",
)


class ProtocolError(KvrtError):
    """A request line the daemon cannot act on; ``code`` goes on the ``ERR`` line."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)

    def reply(self) -> str:
        return error_line(self.code, str(self))


@dataclass(frozen=True)
class Command:
    verb: str
    args: tuple[Any, ...]


# verb -> (minimum, maximum) number of whitespace-separated arguments (DECODE: see below)
_ARITY: dict[str, tuple[int, int]] = {
    "HELP": (0, 0), "STATUS": (0, 0), "LIST": (0, 0), "QUIT": (0, 0),
    "REGISTER": (2, 6), "UNREGISTER": (1, 1), "METRICS": (0, 1), "FORK": (2, 2), "CANCEL": (1, 1),
}


def _number(text: str, what: str, low: int, high: int) -> int:
    if not _NUMBER.match(text):
        raise ProtocolError("BAD_NUMBER", f"{what} must be a decimal integer in [{low}, {high}], got {text[:40]!r}")
    value = int(text)
    if not low <= value <= high:
        raise ProtocolError("BAD_NUMBER", f"{what} {value} is outside [{low}, {high}]")
    return value


def unescape_prompt(text: str) -> str:
    """``\\n`` -> newline, ``\\\\`` -> backslash; any other escape is refused."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1:i + 2]
        if nxt == "n":
            out.append("\n")
        elif nxt == "\\":
            out.append("\\")
        else:
            raise ProtocolError("BAD_ARGS", f"unknown escape '\\{nxt}' in prompt at character {i}: use \\n or \\\\")
        i += 2
    return "".join(out)


def escape_prompt(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n")


def line_too_long(length: int) -> str:
    """The refusal of a request line of ``length`` bytes (its newline included)."""
    return f"request line of {length} bytes (newline included) exceeds the limit of {MAX_LINE} bytes"


def parse_line(raw: bytes) -> Command:
    """One request line (with or without its ``\\n``) as a :class:`Command`."""
    length = len(raw) + (not raw.endswith(b"\n"))  # as sent, with its newline
    if length > MAX_LINE:
        raise ProtocolError("LINE_TOO_LONG", line_too_long(length))
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError("BAD_UTF8", f"request is not valid UTF-8 (byte {exc.start})") from None
    line = line.rstrip("\r\n")
    if "\x00" in line or "\n" in line or "\r" in line:
        raise ProtocolError("BAD_ARGS", "request contains a NUL or a line break inside the line")
    stripped = line.strip()
    if not stripped:
        raise ProtocolError("EMPTY", "empty request line; send HELP for the verbs")
    verb, _, rest = stripped.partition(" ")
    verb = verb.upper()
    if verb == "DECODE":  # the prompt keeps its trailing whitespace: only the line's end was stripped
        return _parse_decode(line.lstrip().partition(" ")[2])
    if verb not in _ARITY:
        raise ProtocolError("UNKNOWN_VERB", f"unknown verb {verb[:40]!r}; send HELP for the verbs")
    args = rest.split()
    low, high = _ARITY[verb]
    if not low <= len(args) <= high:
        want = str(low) if low == high else f"{low} to {high}"
        raise ProtocolError("BAD_ARGS", f"{verb} takes {want} argument(s), got {len(args)}")
    if verb == "REGISTER":
        return _parse_register(args)
    return Command(verb, tuple(args))


_REGISTER_OPTIONS = ("policy", "min_ctx", "keep")
POLICIES = ("refuse", "shift", "grow")


def _parse_register(args: list[str]) -> Command:
    """``<agent_id> <model_path> [n_ctx] [key=value…]`` as (agent_id, model_path, n_ctx, policy, min_ctx, keep)."""
    rest = args[2:]
    n_ctx = 4096
    if rest and "=" not in rest[0]:
        n_ctx = _number(rest.pop(0), "n_ctx", 1, MAX_CTX)
    options: dict[str, str] = {}
    for word in rest:
        key, eq, value = word.partition("=")
        if not eq or key not in _REGISTER_OPTIONS:
            raise ProtocolError("BAD_ARGS", f"REGISTER option {word[:40]!r} is not one of "
                                            f"{', '.join(k + '=' for k in _REGISTER_OPTIONS)}")
        if key in options:
            raise ProtocolError("BAD_ARGS", f"REGISTER option {key}= given twice")
        options[key] = value
    policy = options.get("policy", "refuse")
    if policy not in POLICIES:
        raise ProtocolError("BAD_ARGS", f"policy must be one of {', '.join(POLICIES)}, got {policy[:40]!r}")
    min_ctx = _number(options["min_ctx"], "min_ctx", 1, MAX_CTX) if "min_ctx" in options else None
    keep = _number(options["keep"], "keep", 0, MAX_CTX) if "keep" in options else None
    return Command("REGISTER", (args[0], args[1], n_ctx, policy, min_ctx, keep))


@dataclass(frozen=True)
class DecodeOptions:
    """What a DECODE line asked for beyond lmxd's three arguments (``None``: the default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    deadline_ms: int | None = None
    stream: bool = False


_OPTION = re.compile(r'([A-Za-z_]+)=("(?:[^"\\]|\\.)*"|\S+)\s*')
_REAL = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,9})?$")


def _option(key: str, raw: str) -> Any:
    if key in ("temperature", "top_p"):
        if not _REAL.match(raw):
            raise ProtocolError("BAD_NUMBER", f"{key} must be a non-negative decimal number, got {raw[:40]!r}")
        return float(raw)
    if key in ("top_k", "seed", "deadline_ms"):
        return _number(raw, key, 0 if key != "deadline_ms" else 1, 2**32 - (2 if key == "seed" else 1))
    if key == "stream":
        if raw not in ("0", "1"):
            raise ProtocolError("BAD_ARGS", f"stream must be 0 or 1, got {raw[:40]!r}")
        return raw == "1"
    if raw.startswith('"'):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ProtocolError("BAD_ARGS", f"stop value {raw[:40]!r} is not a valid JSON string") from None
    if not raw:
        raise ProtocolError("BAD_ARGS", "a stop string cannot be empty")
    return raw


def _parse_options(text: str) -> DecodeOptions | None:
    """The ``key=value…`` words before a lone ``--``; ``None`` when ``text`` is not such a list."""
    values: dict[str, Any] = {}
    stops: list[str] = []
    pos = 0
    while pos < len(text):
        match = _OPTION.match(text, pos)
        if match is None:
            return None
        key = match.group(1)
        if key not in DecodeOptions.__dataclass_fields__:
            return None
        value = _option(key, match.group(2))
        if key == "stop":
            stops.append(value)
        elif key in values:
            raise ProtocolError("BAD_ARGS", f"DECODE option {key}= given twice")
        else:
            values[key] = value
        pos = match.end()
    return DecodeOptions(**values, stop=tuple(stops))


def _parse_decode(rest: str) -> Command:
    parts = rest.lstrip().split(" ", 2)
    if len(parts) < 3 or not parts[2].strip():
        raise ProtocolError("BAD_ARGS", "DECODE takes <agent_id> <n_tokens> [key=value… --] <prompt…> "
                                        "(a non-empty prompt)")
    agent_id, count, prompt = parts
    options = DecodeOptions()
    head, sep, tail = prompt.partition(" -- ")
    if sep and tail.strip():
        parsed = _parse_options(head.strip())
        if parsed is not None:
            options, prompt = parsed, tail
    return Command("DECODE", (agent_id, _number(count, "n_tokens", 1, MAX_TOKENS), unescape_prompt(prompt), options))


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3f}"
    text = "none" if value is None else str(value)
    return json.dumps(text, ensure_ascii=False) if not text or any(c.isspace() or c in "\"'" for c in text) else text


def ok_line(*words: str, **fields: Any) -> str:
    """``OK word… key=value…`` (values with spaces or quotes are JSON-quoted)."""
    return " ".join(["OK", *words, *(f"{k}={_value(v)}" for k, v in fields.items())])


def error_line(code: str, message: str) -> str:
    return f"ERR {code} " + " ".join(message.split())


def error_reply(exc: BaseException) -> str:
    """The ``ERR`` line for ``exc``, whatever layer raised it (the daemon's one exception mapping).

    A ledger refusal keeps the seed's line (``external_bytes`` added only when non-zero);
    anything that is not a :class:`KvrtError` is a bug and answers ``ERR INTERNAL``.
    """
    if isinstance(exc, LedgerDenied):
        line = (f"ERR VRAM_LEDGER_DENY code={exc.code} ledger_max_bytes={exc.max_bytes} "
                f"ledger_allocated_bytes={exc.allocated_bytes} request_table_bytes={exc.request_bytes}")
        return line + (f" external_bytes={exc.external_bytes}" if exc.external_bytes else "")
    if isinstance(exc, (ProtocolError, SchedulerError)):
        return error_line(exc.code, str(exc))
    if isinstance(exc, InvalidArgument):
        return error_line("BAD_ARGS", str(exc))
    if isinstance(exc, EngineClosed):  # a batched turn still running when the daemon shut down
        return error_line("SHUTTING_DOWN", str(exc))
    if isinstance(exc, (ModelLoadError, EstimateError)):
        return error_line("MODEL_LOAD", str(exc))
    if isinstance(exc, ContextError):
        return error_line("CONTEXT", str(exc))
    if isinstance(exc, AgentStoreError):
        return error_line("STATE_NOT_SAVED", str(exc))
    if isinstance(exc, KvrtError):
        return error_line("FAILED", str(exc))
    return error_line("INTERNAL", f"{type(exc).__name__}: {exc}")


def reply(*lines: str) -> bytes:
    """A whole reply: its lines plus the ``END`` terminator, ready to send at once."""
    return ("\n".join((*lines, END)) + "\n").encode("utf-8")


def token_line(text: str) -> str:
    """One streamed piece of generated text (JSON-quoted, so it never breaks the line framing)."""
    return "TOKEN text=" + json.dumps(text, ensure_ascii=False)


def response_block(text: str) -> list[str]:
    """The generated text between ``BEGIN_RESPONSE bytes=N`` and ``END_RESPONSE``."""
    return [f"BEGIN_RESPONSE bytes={len(text.encode('utf-8'))}", text, "END_RESPONSE"]


def parse_fields(line: str) -> dict[str, str]:
    """``key=value`` pairs of an ``OK``/``ERR`` line (bare words and free text are skipped)."""
    out: dict[str, str] = {}
    for match in _FIELD.finditer(line):
        key, value = match.group(1), match.group(2)
        out[key] = json.loads(value) if value.startswith('"') else value
    return out
