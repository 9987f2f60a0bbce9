"""Strict-mode checks of tool definitions, the way the OpenAI API checks them.

Holds :func:`tool_definition_problems` and :func:`strict_schema_problems` (both
re-exported by :mod:`hermes_modal_tool.testing.openai_server`, which is where the
tests of the OpenAI adapter import them from). :mod:`._openai_model` uses them to
reject a request whose tools the real API would reject. Stdlib only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["JSON_TYPES", "MAX_DEPTH", "NAME_RE", "STRICT_KEYWORDS", "strict_schema_problems",
           "tool_definition_problems"]

NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: JSON-schema keywords strict mode accepts (anything else is rejected, e.g. ``default``).
STRICT_KEYWORDS = frozenset({
    "type", "description", "title", "properties", "required", "additionalProperties", "items",
    "enum", "const", "anyOf", "$defs", "definitions", "$ref", "pattern", "format", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems"})
JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
MAX_DEPTH = 10


def tool_definition_problems(tool: Any, api: str, require_strict: bool = True) -> list[str]:
    """What is wrong with one tool definition for ``api`` (``"chat"`` or ``"responses"``).

    A Responses API ``custom`` (free-form) tool, such as the Agents SDK's
    ``apply_patch``, is accepted when it has a valid name and description; the
    script never calls it.
    """
    if api == "responses" and isinstance(tool, Mapping) and tool.get("type") == "custom":
        name = tool.get("name")
        problems = [f"custom tool {name}: unexpected key {k!r}"
                    for k in sorted(set(tool) - {"type", "name", "description", "format"})]
        if not isinstance(name, str) or not NAME_RE.match(name):
            problems.append(f"invalid custom tool name {name!r}: must match {NAME_RE.pattern}")
        if not isinstance(tool.get("description", ""), str):
            problems.append(f"custom tool {name}: description must be a string")
        return problems
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        return [f"tool {tool!r:.80}: only function tools are scripted here ('type': 'function')"]
    if api == "chat":
        extra = set(tool) - {"type", "function"}
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            return ["chat tools need a 'function' object: {'type': 'function', 'function': {...}}"]
        allowed = {"name", "description", "parameters", "strict"}
    else:
        fn, extra = tool, set()
        if "function" in tool:
            return ["Responses API tools are flat ({'type': 'function', 'name': ...}); "
                    "found a Chat Completions 'function' wrapper"]
        allowed = {"type", "name", "description", "parameters", "strict"}
    name = fn.get("name")
    problems = [f"tool {name}: unexpected key {k!r}" for k in sorted(extra | (set(fn) - allowed))]
    if not isinstance(name, str) or not NAME_RE.match(name):
        problems.append(f"invalid function name {name!r}: must match {NAME_RE.pattern}")
    if not isinstance(fn.get("description", ""), str):
        problems.append(f"tool {name}: description must be a string")
    if require_strict and fn.get("strict") is not True:
        problems.append(f"tool {name}: 'strict' must be true, got {fn.get('strict')!r}")
    if fn.get("strict") is True:
        problems += strict_schema_problems(fn.get("parameters"), f"{name}.parameters")
    return problems


def strict_schema_problems(schema: Any, where: str = "parameters") -> list[str]:
    """What in a function's ``parameters`` breaks OpenAI's strict-mode rules."""
    if not isinstance(schema, Mapping):
        return [f"{where}: must be a JSON schema object"]
    problems = []
    if schema.get("type") != "object" or "anyOf" in schema:
        problems.append(f"{where}: the root must be an object schema (type 'object', not anyOf)")
    _walk(schema, where, 0, problems)
    return problems


def _types(node: Mapping[str, Any]) -> list[str]:
    t = node.get("type")
    return [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []


def _json_type(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"object"} if isinstance(value, dict) else {"array"}


def _walk(node: Any, path: str, depth: int, problems: list[str]) -> None:
    if depth > MAX_DEPTH:
        problems.append(f"{path}: nested deeper than {MAX_DEPTH} levels")
        return
    if not isinstance(node, Mapping):
        problems.append(f"{path}: a schema must be an object, got {node!r:.60}")
        return
    problems += [f"{path}: '{k}' is not permitted in strict mode" for k in node if k not in STRICT_KEYWORDS]
    types = _types(node)
    if "type" in node and (not types or any(t not in JSON_TYPES for t in types)):
        problems.append(f"{path}: invalid type {node['type']!r}")
    if "type" not in node and not any(k in node for k in ("anyOf", "$ref", "enum", "const")):
        problems.append(f"{path}: every schema needs a 'type' (or anyOf/$ref/enum/const)")
    if "enum" in node:
        values = node["enum"]
        if not isinstance(values, list) or not values:
            problems.append(f"{path}: enum must be a non-empty list")
        elif types:
            problems += [f"{path}: enum value {v!r} is not of type {types}"
                         for v in values if not _json_type(v) & set(types)]
    if "object" in types or "properties" in node:
        props = node.get("properties", {})
        if node.get("additionalProperties") is not False:
            problems.append(f"{path}: 'additionalProperties' must be false")
        required = node.get("required")
        if not isinstance(required, list) or set(required) != set(props) or len(set(required)) != len(required):
            missing = sorted(set(props) - set(required or []))
            problems.append(f"{path}: 'required' must list every property exactly once (missing: {missing})")
        for key, sub in (props.items() if isinstance(props, Mapping) else []):
            _walk(sub, f"{path}.{key}", depth + 1, problems)
    if "items" in node:
        _walk(node["items"], f"{path}[]", depth + 1, problems)
    if "anyOf" in node:
        variants = node["anyOf"]
        if not isinstance(variants, list) or not variants:
            problems.append(f"{path}: anyOf must be a non-empty list")
        else:
            for i, sub in enumerate(variants):
                _walk(sub, f"{path}.anyOf[{i}]", depth, problems)
    for defs_key in ("$defs", "definitions"):
        for key, sub in (node.get(defs_key) or {}).items():
            _walk(sub, f"{path}.{defs_key}.{key}", depth + 1, problems)
