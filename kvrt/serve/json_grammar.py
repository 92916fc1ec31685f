"""JSON schemas turned into GBNF for llama.cpp's grammar sampler (``response_format`` and tool calls).

One :class:`GrammarBuilder` holds one llama-cpp-python ``SchemaConverter``, so several schemas
(each tool's parameters) become rules of one grammar that share the converter's common
rules (``space``, ``string``, ...) and keep their own ``$ref`` targets apart (each schema's
references are resolved under its own URL). A schema the converter cannot express is an
:class:`ApiError` (400) naming the request field it came from; nothing is allocated before.
"""

from __future__ import annotations

import json
from typing import Any

from kvrt.serve.api_error import ApiError

_ROOT_DEF = "kvrt-root"


class GrammarBuilder:
    """Rules of one grammar: schemas added with :meth:`add`, plain GBNF rules with :meth:`rule`."""

    def __init__(self, prop_order: tuple[str, ...] = ()) -> None:
        from llama_cpp.llama_grammar import SchemaConverter

        self._converter = SchemaConverter(prop_order={name: i for i, name in enumerate(prop_order)},
                                          allow_fetch=False, dotall=False, raw_pattern=False)

    def add(self, schema: dict[str, Any], name: str, *, param: str) -> str:
        """Rules for ``schema`` (its root rule named ``name``; ``""`` is the grammar's ``root``); returns the root
        rule's name. ``param`` is the request field a refusal names."""
        schema = local_refs(schema, param)
        try:
            resolved = self._converter.resolve_refs(schema, f"kvrt:{param}")
            return str(self._converter.visit(resolved, name))
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
