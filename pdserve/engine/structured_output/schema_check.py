"""The JSON Schema subset pdserve enforces, and the check that refuses everything else.

NOTE: a keyword the grammar engine would silently ignore is a relaxation the client never
asked for (``uniqueItems`` not enforced means duplicates in the "valid" output). So a
schema is walked before it is compiled, and any keyword outside the lists below is refused
with an error that names it and where it is. Each enforced keyword has a test that a
violating value is rejected by the compiled grammar (``tests/test_structured_output.py``).
"""

from __future__ import annotations

import json
from typing import Any

#: Keywords the grammar enforces (xgrammar 0.2, checked one by one by the tests).
ENFORCED_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
    # objects
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    # arrays
    "items", "prefixItems", "minItems", "maxItems",
    # strings
    "minLength", "maxLength", "pattern", "format",
    # numbers
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})

#: Keywords that never change which values are valid (annotations); accepted as they are.
ANNOTATION_KEYWORDS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", "discriminator",
    "contentEncoding", "contentMediaType",
})

#: ``format`` values the grammar enforces.
ENFORCED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "uuid", "ipv4", "ipv6", "hostname",
    "uri", "uri-reference",
})

#: Keywords whose value is a map of name -> subschema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
#: Keywords whose value is one subschema.
_SCHEMA_VALUES = ("additionalProperties", "items", "propertyNames")
#: Keywords whose value is a list of subschemas.
_SCHEMA_LISTS = ("anyOf", "prefixItems")
#: Keywords that constrain nothing beside ``enum``, ``const``, ``$ref`` or ``anyOf`` (the
#: grammar compiles those four alone and drops every other constraint next to them).
_INERT = ANNOTATION_KEYWORDS | {"$defs", "definitions"}


class UnsupportedSchemaError(ValueError):
    """A schema uses a keyword (or value) the grammar would not enforce.

    Attributes:
        keyword: the refused keyword (``uniqueItems``), or ``format:<name>``.
        path: JSON-pointer-like location of the schema object holding it (``#/properties/a``).
    """

    def __init__(self, keyword: str, path: str, reason: str = "") -> None:
        self.keyword = keyword
        self.path = path
        detail = reason or "it is not supported by structured outputs"
        super().__init__(f"JSON schema keyword {keyword!r} at {path}: {detail}")


def check_json_schema(schema: Any) -> Any:
    """Validates ``schema`` as a JSON Schema and returns it with trivial wrappers removed.

    A one-element ``allOf`` whose object carries nothing else but annotations (pydantic's
    way to attach a description to a ``$ref``) is replaced by its element. An object schema
    that lists no properties gets ``additionalProperties: true`` made explicit; where
    properties are listed and ``additionalProperties`` is not given, the output holds only
    the listed ones (valid, and what a client parsing into a typed model wants).

    Args:
        schema: the decoded schema (a dict, or a bool: ``true`` allows any value).

    Returns:
        The schema to compile (a new object; the argument is not modified).

    Raises:
        UnsupportedSchemaError: a keyword outside :data:`ENFORCED_KEYWORDS` and
            :data:`ANNOTATION_KEYWORDS`, an unsupported ``format``, or a non-trivial
            ``allOf``.
        ValueError: ``schema`` is not a valid JSON Schema (draft 2020-12 meta-schema).
    """
    import jsonschema  # deferred: only structured-output requests need it

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(f"invalid JSON schema at #/{where}: {exc.message}") from None
    return _check(schema, "#")


def _check(node: Any, path: str) -> Any:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        raise UnsupportedSchemaError(type(node).__name__, path, "a schema must be an object")
    node = _combine_siblings(_unwrap_all_of(node, path), path)
    out: dict[str, Any] = {}
    for keyword, value in node.items():
        if keyword in ANNOTATION_KEYWORDS:
            out[keyword] = value
            continue
        if keyword not in ENFORCED_KEYWORDS:
            raise UnsupportedSchemaError(keyword, path)
        _check_value(keyword, value, node, path)
        if keyword == "format" and value not in ENFORCED_FORMATS:
            raise UnsupportedSchemaError(
                f"format:{value}", path,
                f"format {value!r} is not enforced; supported: {sorted(ENFORCED_FORMATS)}")
        if keyword in _SCHEMA_MAPS:
            value = {name: _check(sub, f"{path}/{keyword}/{name}") for name, sub in value.items()}
        elif keyword in _SCHEMA_VALUES:
            value = _check(value, f"{path}/{keyword}")
        elif keyword in _SCHEMA_LISTS:
            value = [_check(sub, f"{path}/{keyword}/{i}") for i, sub in enumerate(value)]
        out[keyword] = value
    if out.get("type") == "object" and not any(
            k in out for k in ("properties", "patternProperties", "additionalProperties")):
        # JSON Schema allows any property here; say so, or the compiler's strict mode
        # (extra properties off where properties are listed) would allow only {}
        out["additionalProperties"] = True
    return out


def _check_value(keyword: str, value: Any, node: dict, path: str) -> None:
    """Refuses enforced keywords in the forms the compiler would still ignore (probed on
    xgrammar 0.2.9: it warns and drops them)."""
    if keyword == "multipleOf" and not (
            node.get("type") == "integer" and float(value).is_integer()):
        raise UnsupportedSchemaError(
            keyword, path, "multipleOf is enforced only on type integer with an integer "
            "value")
    if keyword == "$ref" and not str(value).startswith("#"):
        raise UnsupportedSchemaError(
            keyword, path, f"only references inside the schema (#/...) are supported, "
            f"got {value!r}")
    if keyword in ("pattern", "patternProperties"):
        from pdserve.engine.structured_output.backend import regex_error

        for pattern in ([value] if keyword == "pattern" else value):
            if (reason := regex_error(pattern)) is not None:
                raise UnsupportedSchemaError(keyword, path, f"pattern {pattern!r}: {reason}")
    if keyword == "required":
        listed = node.get("properties", {})
        missing = [name for name in value if name not in listed]
        if missing:
            raise UnsupportedSchemaError(
                keyword, path, f"it names {missing}, which are not in properties: only "
                "listed properties can be required")


def _combine_siblings(node: dict, path: str) -> dict:
    """``node`` with the constraints beside its ``enum``/``const`` applied to the listed
    values, or beside its ``anyOf`` copied into each branch ((A or B) and S = (A and S) or
    (B and S)); refused beside a ``$ref``."""
    active = [k for k in node if k not in _INERT]
    if "enum" in node or "const" in node:
        return _filter_listed_values(node, path)
    if "$ref" in node and len(active) > 1:
        others = [k for k in active if k != "$ref"]
        raise UnsupportedSchemaError(
            "$ref", path, f"keywords beside $ref ({', '.join(others)}) are not enforced; "
            "put them in the referenced schema")
    if "anyOf" not in node or len(active) == 1:
        return node
    siblings = {k: node[k] for k in active if k != "anyOf"}
    branches = []
    for i, branch in enumerate(node["anyOf"]):
        branch = {} if branch is True else branch
        if branch is False:
            continue
        if isinstance(branch, dict) and ("$ref" in branch or set(branch) & set(siblings)):
            raise UnsupportedSchemaError(
                "anyOf", f"{path}/anyOf/{i}", f"the keywords beside anyOf ({', '.join(siblings)}) "
                "cannot be merged into this branch (it has a $ref or the same keywords)")
        branches.append({**branch, **siblings} if isinstance(branch, dict) else branch)
    return {**{k: v for k, v in node.items() if k in _INERT}, "anyOf": branches}


def _filter_listed_values(node: dict, path: str) -> dict:
    """``enum``/``const`` keeping only the values the other keywords of ``node`` allow."""
    import jsonschema

    keyword = "const" if "const" in node else "enum"
    values = [node["const"]] if keyword == "const" else list(node["enum"])
    siblings = {k: v for k, v in node.items() if k not in _INERT and k not in ("enum", "const")}
    if "enum" in node and keyword == "const":
        siblings["enum"] = node["enum"]
    if siblings:
        if "$ref" in json.dumps(siblings):
            raise UnsupportedSchemaError(keyword, path, f"{keyword} beside a $ref is not "
                                         "supported")
        validator = jsonschema.Draft202012Validator(
            siblings, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        values = [v for v in values if validator.is_valid(v)]
    if not values:
        raise UnsupportedSchemaError(
            keyword, path, f"no value it lists satisfies the keywords beside it "
            f"({', '.join(siblings)}): nothing could be generated")
    out = {k: v for k, v in node.items() if k in _INERT}
    out[keyword] = values[0] if keyword == "const" else values
    return out


def _unwrap_all_of(node: dict, path: str) -> dict:
    if "allOf" not in node:
        return node
    parts = node["allOf"]
    rest = {k: v for k, v in node.items() if k != "allOf"}
    if len(parts) != 1 or not isinstance(parts[0], dict):
        raise UnsupportedSchemaError(
            "allOf", path, "only a one-element allOf (a $ref with annotations) is supported")
    others = [k for k in rest if k not in _INERT]
    if others:
        raise UnsupportedSchemaError(
            "allOf", path, f"keywords beside a one-element allOf ({', '.join(others)}) are "
            "not supported; put them in its element")
    return {**parts[0], **rest}
