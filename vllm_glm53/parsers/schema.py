"""Typing tool-call arguments from the request's JSON schema.

GLM writes every argument value as raw text (``<arg_value>3</arg_value>``). The value becomes a JSON value
through the tool's parameter schema: a property typed ``string`` (or unknown to the schema, or any property
when the request has no tools) keeps the raw text; otherwise the listed types are tried in the order
null, integer, number, boolean, object, array, string, and the first that reads the text wins. When none
does, the text is read as JSON if it is JSON, and kept as a string otherwise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
# Type names models and schema writers use besides JSON Schema's own.
_ALIASES = {
    "str": "string", "text": "string", "char": "string", "varchar": "string", "enum": "string",
    "int": "integer", "long": "integer", "short": "integer", "int32": "integer", "int64": "integer",
    "uint": "integer", "uint32": "integer", "uint64": "integer", "unsigned": "integer",
    "float": "number", "double": "number", "decimal": "number", "real": "number", "num": "number",
    "bool": "boolean",
    "dict": "object", "map": "object", "obj": "object",
    "list": "array", "tuple": "array", "arr": "array",
    "none": "null", "nil": "null",
}  # fmt: skip
_ENUM_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def schema_types(schema: Any) -> frozenset[str]:
    """The JSON types a schema admits: ``type`` (a name or a list), the types of ``enum`` values, and the
    branches of ``anyOf``/``oneOf``/``allOf``. A schema that says nothing admits ``string``."""
    types: set[str] = set()
    if isinstance(schema, Mapping):
        declared = schema.get("type")
        for name in [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []:
            if isinstance(name, str):
                name = name.strip().lower()
                types.add(_ALIASES.get(name, name))
        for value in schema.get("enum") if isinstance(schema.get("enum"), list) else ():
            types.add("null" if value is None else next(t for cls, t in _ENUM_TYPES if isinstance(value, cls)))
        for branch_key in ("anyOf", "oneOf", "allOf"):
            for branch in schema.get(branch_key) if isinstance(schema.get(branch_key), list) else ():
                types |= schema_types(branch)
    return frozenset(types) if types else frozenset({"string"})


def is_string_only(schema: Any) -> bool:
    """A value for this schema is always the raw text (so it can stream before it is complete)."""
    return schema_types(schema) == {"string"}


def _read(kind: str, text: str) -> tuple[bool, Any]:
    stripped = text.strip()
    if kind == "null":
        return stripped.lower() == "null", None
    if kind == "integer":
        try:
            return True, int(stripped)
        except ValueError:
            return False, None
    if kind == "number":
        try:
            number = float(stripped)
        except ValueError:
            return False, None
        if not math.isfinite(number):
            return False, None
        return True, int(number) if number.is_integer() else number
    if kind == "boolean":
        lowered = stripped.lower()
        if lowered in ("true", "1"):
            return True, True
        if lowered in ("false", "0"):
            return True, False
        return False, None
    if kind in ("object", "array"):
        try:
            value = json.loads(text)
        except ValueError:
            return False, None
        return isinstance(value, dict if kind == "object" else list), value
    return True, text  # string


def coerce(text: str, schema: Any) -> Any:
    """The JSON value of an argument's raw ``text`` under its property ``schema`` (``None``: no schema)."""
    types = schema_types(schema)
    for kind in _ORDER:
        if kind in types:
            ok, value = _read(kind, text)
            if ok:
                break
    else:
        try:
            value = json.loads(text)
        except ValueError:
            return text
    return _coerce_nested(value, schema)


def _coerce_nested(value: Any, schema: Any) -> Any:
    """Type the members of an object or array value by the schema's ``properties`` / ``items``."""
    if not isinstance(schema, Mapping):
        return value
    if isinstance(value, dict) and isinstance(schema.get("properties"), Mapping):
        properties = schema["properties"]
        return {k: _coerce_member(v, properties[k]) if k in properties else v for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [_coerce_member(v, schema["items"]) for v in value]
    return value


def _coerce_member(value: Any, schema: Any) -> Any:
    if isinstance(value, (dict, list)):
        return _coerce_nested(value, schema)
    # A scalar in the wrong type (``"5"`` for an integer, ``5`` for a string) is re-read from its text.
    return coerce(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False), schema)
