"""JSON Schema keywords that xgrammar's converter does not enforce, refused before compiling.

xgrammar (0.2.x) drops some keywords without an error (`if`/`then`/`else`, `not`,
`uniqueItems`, `contains`, `dependentRequired`, ...), merges only one `allOf` branch, ignores
`minLength`/`maxLength` beside a `pattern`, and reads a non-local `$ref` as "anything": the
output would then not validate against the schema the client gave. Issue #13: such a schema is a
400 naming the keyword, never a silent loosening. The walk visits only subschemas (not `const`,
`enum`, `default` or `examples` values, which are data).
"""
from __future__ import annotations

import re
from typing import Any

# keyword -> why (shown to the client)
UNSUPPORTED = {
    "if": "conditional subschemas", "then": "conditional subschemas",
    "else": "conditional subschemas", "not": "negated subschemas",
    "contains": "array containment", "minContains": "array containment",
    "maxContains": "array containment", "dependentRequired": "property dependencies",
    "dependentSchemas": "property dependencies", "dependencies": "property dependencies",
    "$dynamicRef": "dynamic references", "$recursiveRef": "dynamic references",
    "unevaluatedItems": "unevaluated items",
}
# a lookahead / lookbehind group (not an escaped parenthesis): xgrammar ignores lookaheads
_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")
# keywords whose value is one subschema, a list of them, or a name -> subschema map
_ONE = ("items", "additionalProperties", "propertyNames", "additionalItems",
        "unevaluatedProperties", "if", "then", "else", "not", "contains")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


# subschemas nested deeper than this are refused: xgrammar's conversion time grows with the
# cube of the depth (300 levels: 5 s; 400: 35 s), and a local $ref expresses real recursion
MAX_DEPTH = 64


COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


class UnsupportedSchema(ValueError):
    pass


def check_schema(schema: Any, where: str = "#", depth: int = 0) -> None:
    """UnsupportedSchema naming the first keyword (and its place, a JSON pointer) that the
    grammar would not enforce."""
    if not isinstance(schema, dict):
        return  # true / false / a malformed value: xgrammar's own errors name those
    if depth > MAX_DEPTH:
        raise UnsupportedSchema(f"the schema nests subschemas more than {MAX_DEPTH} levels deep "
                                f"(at {where}); use a local $ref for recursive structures")
    for key in COUNTS:  # (a negative one reached xgrammar's EBNF parser: a RuntimeError)
        n = schema.get(key)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise UnsupportedSchema(f"{key} at {where}/{key} must be a non-negative integer, got {n!r}")
    _check_values(schema, where)
    for key, why in UNSUPPORTED.items():
        if key in schema:
            _refuse(f"{where}/{key}", f"{key} ({why})")
    if schema.get("uniqueItems") is True:
        _refuse(f"{where}/uniqueItems", "uniqueItems: true")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        _refuse(f"{where}/allOf", "allOf with more than one subschema")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        _refuse(f"{where}/pattern", "pattern together with minLength/maxLength")
    required, props = schema.get("required"), schema.get("properties", {})
    closed = schema.get("additionalProperties", False) is False and not schema.get("patternProperties")
    if isinstance(required, list) and isinstance(props, dict) and closed:
        missing = [r for r in required if r not in props]
        if missing:  # (xgrammar closes objects by default, so it could never write them)
            _refuse(f"{where}/required", f"required {missing} not among the properties")
    patterns = [schema.get("pattern")] + list((schema.get("patternProperties") or {}).keys())
    if any(isinstance(p, str) and _LOOKAROUND.search(p) for p in patterns):
        _refuse(f"{where}/pattern", "a lookaround group ((?=, (?!, (?<=, (?<!) in a pattern")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        _refuse(f"{where}/$ref", f"$ref {ref!r} (only local '#/...' references)")
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            check_schema(schema[key], f"{where}/{key}", depth + 1)
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{where}/{key}/{i}", depth + 1)
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_schema(sub, f"{where}/{key}/{name}", depth + 1)


TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")


def _check_values(schema: dict, where: str) -> None:
    """Malformed values the converter takes without an error (an empty anyOf read as anything,
    an enum that is not a list): the meta-schema's rules for them."""
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema and (not isinstance(schema[key], list) or not schema[key]):
            raise UnsupportedSchema(f"{key} at {where}/{key} must be a non-empty array of subschemas, "
                                    f"got {schema[key]!r}")
    t = schema.get("type")
    if t is not None and not (t in TYPES if isinstance(t, str) else
                              isinstance(t, list) and t and all(x in TYPES for x in t)):
        raise UnsupportedSchema(f"type at {where}/type must be one of {', '.join(TYPES)} or a non-empty "
                                f"array of them, got {t!r}")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise UnsupportedSchema(f"enum at {where}/enum must be a non-empty array, got {schema['enum']!r}")
    r = schema.get("required")
    if r is not None and not (isinstance(r, list) and all(isinstance(x, str) for x in r)):
        raise UnsupportedSchema(f"required at {where}/required must be an array of property names, got {r!r}")


def _refuse(at: str, what: str) -> None:
    raise UnsupportedSchema(f"unsupported JSON Schema feature at {at}: {what} is not enforced "
                            "by the grammar backend (xgrammar)")
