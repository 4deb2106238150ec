"""The JSON schema of a forced tool call (tool_choice "required"): a list of {"name",
"parameters"} objects, one branch per tool.

Each tool's parameters are a schema of their own, whose local references (`#/$defs/X`, `#`)
point into that schema; pydantic writes them for every nested model. Inlined into the combined
schema they would point into its root instead (xgrammar: "Cannot find field '$defs'"), so each
tool's schema is moved under the root's `$defs` and its references are rewritten to follow it.
"""
from __future__ import annotations

from typing import Any

DATA_KEYS = ("const", "enum", "default", "examples")  # values that are data, not subschemas
# name -> subschema maps: their keys are names (a property may be called "enum" or "$ref")
NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def relocate_refs(schema: Any, base: str) -> Any:
    """`schema` with every local "$ref" ("#" or "#/...") rewritten to start at `base` (a JSON
    pointer such as "#/$defs/tool0")."""
    if isinstance(schema, list):
        return [relocate_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        elif k in DATA_KEYS:
            out[k] = v
        elif k in NAME_MAPS and isinstance(v, dict):
            out[k] = {name: relocate_refs(sub, base) for name, sub in v.items()}
        else:
            out[k] = relocate_refs(v, base)
    return out


def required_calls_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    """One or more calls (at most one if not `parallel`), each naming a tool and giving its
    arguments; `schemas` maps tool name → parameters schema."""
    defs, branches = {}, []
    for i, (name, params) in enumerate(schemas.items()):
        key = f"tool{i}"
        defs[key] = relocate_refs(params, f"#/$defs/{key}")
        branches.append({"type": "object", "properties": {
            "name": {"const": name}, "parameters": {"$ref": f"#/$defs/{key}"}},
            "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema
