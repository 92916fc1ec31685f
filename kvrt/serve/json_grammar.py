"""JSON schemas turned into GBNF for llama.cpp's grammar sampler (``response_format`` and tool calls).

One :class:`GrammarBuilder` holds one llama-cpp-python ``SchemaConverter``, so several schemas
(each tool's parameters) become rules of one grammar that share the converter's common
rules (``space``, ``string``, ...) and keep their own ``$ref`` targets apart (each schema's
references are resolved under its own URL). A schema the converter cannot express is an
:class:`ApiError` (400) naming the request field it came from; nothing is allocated before.

Bounds: an ``integer``'s ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum``
(numbers, or draft 4's boolean ``exclusive*`` beside ``minimum`` / ``maximum``) are enforced,
the integers in range written by :func:`kvrt.serve.integer_range.integer_range` (the converter
ignores them); bounds no integer fits, or that are not numbers, are a 400. A ``number``'s bounds
are not enforced (a digit-range construction for decimals and exponents is not written).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from kvrt.serve.api_error import ApiError
from kvrt.serve.integer_range import integer_range

_ROOT_DEF = "kvrt-root"
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_BEFORE_TYPE = ("$ref", "oneOf", "anyOf", "const", "enum")  # keys the converter reads before a schema's type


class GrammarBuilder:
    """Rules of one grammar: schemas added with :meth:`add`, plain GBNF rules with :meth:`rule`."""

    def __init__(self, prop_order: tuple[str, ...] = ()) -> None:
        self._converter = _converter_class()(prop_order={name: i for i, name in enumerate(prop_order)},
                                             allow_fetch=False, dotall=False, raw_pattern=False)

    def add(self, schema: dict[str, Any], name: str, *, param: str) -> str:
        """Rules for ``schema`` (its root rule named ``name``; ``""`` is the grammar's ``root``); returns the root
        rule's name. ``param`` is the request field a refusal names."""
        schema = local_refs(schema, param)
        try:
            resolved = self._converter.resolve_refs(schema, f"kvrt:{param}")
            return str(self._converter.visit(resolved, name))
        except _BadBounds as exc:
            raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_schema") from None
        except Exception as exc:  # the converter raises plain exceptions for schemas it cannot express
            raise ApiError(400, f"{param}: the JSON schema cannot be converted to a grammar ({exc})", param=param,
                           code="invalid_schema") from None

    def rule(self, name: str, body: str) -> str:
        """Add the GBNF rule ``name ::= body``; returns its (possibly suffixed) name."""
        return str(self._converter._add_rule(name, body))

    def literal(self, text: str) -> str:
        """``text`` as a GBNF string literal."""
        return str(self._converter._format_literal(text))

    def text(self) -> str:
        return str(self._converter.format_grammar())


class _BadBounds(ValueError):
    """An integer's bounds that no integer fits, or that are not numbers."""


@functools.cache
def _converter_class() -> Any:
    """llama-cpp-python's ``SchemaConverter`` with integer bounds enforced (it writes every integer alike);
    llama_cpp is imported on first use, as it was before this subclass."""
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

    class Converter(SchemaConverter):  # type: ignore[misc]  # llama-cpp-python is Any to the type check
        def visit(self, schema: dict[str, Any], name: str) -> str:
            kind = schema.get("type")
            bounded = any(k in schema for k in _BOUNDS) and not any(k in schema for k in _BEFORE_TYPE)
            if bounded and kind == "integer":
                lo, hi = integer_bounds(schema)
                rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
                return str(self._add_rule(rule_name, f"{integer_range(lo, hi)} space"))
            if bounded and isinstance(kind, list) and "integer" in kind:
                # the converter would write each type bare ({"type": t}), dropping the bounds
                rest = {k: v for k, v in schema.items() if k != "type"}
                return str(super().visit({"anyOf": [{**rest, "type": t} for t in kind]}, name))
            return str(super().visit(schema, name))

    return Converter


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The least and greatest integers ``schema``'s bounds allow (``None``: that side is open); raises
    :class:`_BadBounds` for a bound that is not a finite number (draft 4's boolean ``exclusive*`` aside) and
    for bounds that no integer fits."""
    for key in _BOUNDS:
        value = schema.get(key, 0)
        if isinstance(value, bool) and key.startswith("exclusive"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _BadBounds(f"{key} must be a finite number, got {value!r}")
    lows, highs = [], []
    if "minimum" in schema:
        least = schema["minimum"]
        lows.append(math.floor(least) + 1 if schema.get("exclusiveMinimum") is True else math.ceil(least))
    if "maximum" in schema:
        most = schema["maximum"]
        highs.append(math.ceil(most) - 1 if schema.get("exclusiveMaximum") is True else math.floor(most))
    if not isinstance(schema.get("exclusiveMinimum", False), bool):
        lows.append(math.floor(schema["exclusiveMinimum"]) + 1)
    if not isinstance(schema.get("exclusiveMaximum", False), bool):
        highs.append(math.ceil(schema["exclusiveMaximum"]) - 1)
    lo, hi = max(lows, default=None), min(highs, default=None)
    if lo is not None and hi is not None and lo > hi:
        shown = ", ".join(f"{k} {schema[k]!r}" for k in _BOUNDS if k in schema)
        raise _BadBounds(f"no integer fits the bounds ({shown})")
    return lo, hi


def schema_grammar(schema: dict[str, Any], *, param: str) -> str:
    """GBNF accepting exactly the JSON documents that ``schema`` describes (the same text as
    llama-cpp-python's ``json_schema_to_gbnf``, with ``$ref`` shapes it cannot follow rewritten first)."""
    builder = GrammarBuilder()
    builder.add(schema, "", param=param)
    return builder.text()


def local_refs(schema: dict[str, Any], param: str) -> dict[str, Any]:
    """``schema`` with its ``$ref`` recursion in the shape llama-cpp-python's converter follows.

    The converter resolves ``#/...`` references but never looks inside the node that holds a
    ``$ref``: a root that is itself a reference (``{"$ref": "#/$defs/node", "$defs": ...}``) left
    the definitions' own references unresolved (a bare ``KeyError`` came back), and ``"#"`` (the
    whole document) it refuses. Here the root's reference moves into an ``anyOf`` of one, ``"#"``
    becomes a reference to a copy of the root under ``$defs``, and every reference must be local
    and resolve; anything else is a 400 that names the reference and ``param``. A schema without
    references comes back as it is; any other is a copy.
    """
    refs: list[str] = []
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                refs.append(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    if not refs:
        return schema
    for ref in refs:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ApiError(400, f"{param}: $ref {ref!r} is not supported: only local references (\"#\" or "
                                "\"#/...\" into the schema itself) are", param=param, code="unsupported_schema")
    schema = json.loads(json.dumps(schema))  # a copy to rewrite
    if "#" in refs:
        body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
        schema = {**{k: v for k, v in schema.items() if k in ("$defs", "definitions")}, "$ref": f"#/$defs/{_ROOT_DEF}"}
        schema.setdefault("$defs", {})[_ROOT_DEF] = body
        stack = [schema]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if node.get("$ref") == "#":
                    node["$ref"] = f"#/$defs/{_ROOT_DEF}"
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    for ref in {r for r in refs if r != "#"}:
        target: Any = schema
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ApiError(400, f"{param}: $ref {ref!r} does not resolve (no {part!r} there)", param=param,
                               code="invalid_schema")
            target = target[part]
    if "$ref" in schema:
        ref = schema.pop("$ref")
        schema["anyOf"] = [{"$ref": ref}]
    return schema
