"""Which JSON-schema keywords the grammar enforces: the one allow list, and :func:`check_schema_keywords`, which
refuses (ValueError naming the keyword and where it is) every schema the grammar would not hold exactly.

Found by testing xgrammar 0.2.9's converter keyword by keyword (``tests/structured/test_schema_keywords.py``
keeps each verdict: for every keyword allowed here, an output breaking it is rejected by the grammar):

- enforced: ``type`` (a name or a list), ``enum``, ``const``, ``anyOf``, ``allOf`` with one subschema, local
  ``$ref`` (``#``, ``#/$defs/...``, any ``#/`` JSON pointer) with ``$defs`` / ``definitions``; objects:
  ``properties``, ``required``, ``additionalProperties``, ``unevaluatedProperties``, ``propertyNames``,
  ``minProperties``, ``maxProperties``; arrays: ``items``, ``prefixItems``, ``unevaluatedItems``, ``minItems``,
  ``maxItems``; strings: ``minLength``, ``maxLength``, ``pattern``, ``format`` (the formats in
  ``ENFORCED_FORMATS``); numbers: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``, and
  ``multipleOf`` for integers;
- ``oneOf`` when its branches cannot overlap (disjoint types, or objects told apart by a required ``const`` /
  ``enum`` property, as pydantic writes tagged unions): xgrammar enforces it as ``anyOf``, which is then exact;
  other ``oneOf`` is refused (an output matching two branches would pass);
- ignored by xgrammar, so refused: ``allOf`` of several subschemas, ``not``, ``if``/``then``/``else``, ``dependentRequired``,
  ``dependentSchemas``, ``dependencies``, ``patternProperties`` (it rejects every object), ``uniqueItems: true``,
  ``contains``/``minContains``/``maxContains``, ``additionalItems``, ``$anchor``/``$dynamicRef`` and other
  anchors, ``contentEncoding``/``contentMediaType``/``contentSchema``, OpenAPI's ``nullable``, ``multipleOf`` on
  a number, other formats, and any keyword not listed (a typo such as ``minLenght`` is not silently ignored);
- combinations xgrammar drops a part of, so refused: a keyword of one type without a ``type`` naming that type
  (``{"minimum": 3}`` alone), ``minLength``/``maxLength``/``pattern`` next to ``format`` or length next to
  ``pattern``, any constraint next to ``$ref``, ``anyOf`` or ``allOf``, ``enum``/``const`` next to a constraint
  other than ``type`` (and values of another type), ``required`` naming a property not in ``properties``, and an
  empty ``anyOf`` (no value could be written).

Lengths and counts (``minLength`` ... ``maxProperties``) are ints in [0, ``MAX_SCHEMA_COUNT``].

Annotations (``title``, ``description``, ``default``, ``examples``, ...) and ``x-`` extensions are accepted and do
not constrain.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
                         "readOnly", "writeOnly", "discriminator"})
DEFINITIONS = ("$defs", "definitions")
GENERIC = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", *DEFINITIONS})
# keyword -> the JSON types (of ``type``) it constrains; it needs one of them named in ``type``
TYPED = {
    **dict.fromkeys(("properties", "required", "additionalProperties", "unevaluatedProperties", "propertyNames",
                     "minProperties", "maxProperties"), ("object",)),
    **dict.fromkeys(("items", "prefixItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems"), ("array",)),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), ("string",)),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), ("integer", "number")),
    "multipleOf": ("integer",),
}
ENFORCED = GENERIC | set(TYPED)
ENFORCED_FORMATS = frozenset({"email", "date", "date-time", "time", "duration", "uuid", "uri", "uri-reference",
                              "uri-template", "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer"})
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
MAX_SCHEMA_COUNT = 1_000_000  # a length or count bound past any context length (xgrammar fails past 10**15)
REFUSED = {
    "not": "the grammar cannot exclude values", "if": "conditional schemas are not enforced",
    "then": "conditional schemas are not enforced", "else": "conditional schemas are not enforced",
    "dependentRequired": "dependencies between properties are not enforced",
    "dependentSchemas": "dependencies between properties are not enforced",
    "dependencies": "dependencies between properties are not enforced",
    "patternProperties": "list the properties in properties instead",
    "contains": "not enforced", "minContains": "not enforced", "maxContains": "not enforced",
    "additionalItems": "use prefixItems + items (draft 2020-12)",
    "nullable": 'an OpenAPI keyword; write "type": [..., "null"]',
}
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", *DEFINITIONS)
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_JSON_TYPES = {"object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,), "null": (type(None),),
               "integer": (int,), "number": (int, float)}


def check_schema_keywords(schema: Any, where: str = "schema") -> None:
    """ValueError naming the first keyword (and its path under ``where``) the grammar would not enforce."""
    stack: list[tuple[Any, str, tuple[str, ...]]] = [(schema, where, ())]
    while stack:
        node, path, implied = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, Mapping):
            raise ValueError(f"{path}: expected a JSON schema (an object or a boolean), got {type(node).__name__}")
        _check_node(node, path, implied, schema)
        for key in _SUBSCHEMA:
            if key in node:  # property names are strings whether or not their schema says so
                stack.append((node[key], f"{path}.{key}", ("string",) if key == "propertyNames" else ()))
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), Mapping):
                stack.extend((sub, f"{path}.{key}.{name}", ()) for name, sub in node[key].items())
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{path}.{key}[{i}]", ()) for i, sub in enumerate(node[key]))


def _refuse(path: str, key: str, why: str) -> ValueError:
    return ValueError(f"{path}: JSON-schema keyword {key!r} is not supported: {why}")


def _check_node(node: Mapping[str, Any], path: str, implied: tuple[str, ...], root: Any) -> None:
    for key in node:
        if not isinstance(key, str):
            raise ValueError(f"{path}: keys must be strings")
        if key in ENFORCED or key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key in REFUSED:
            raise _refuse(path, key, REFUSED[key])
        raise _refuse(path, key, "the grammar does not enforce it (see README.md, \"Structured output\")")
    constraints = [k for k in node if k in ENFORCED and k not in DEFINITIONS]
    types = _types(node.get("type"), path) or implied
    for key in constraints:
        kinds = TYPED.get(key)
        if kinds is not None and not any(t in types for t in kinds):
            raise _refuse(path, key, f"it needs \"type\": {' or '.join(map(repr, kinds))} next to it")
    for key in ("$ref", "anyOf", "oneOf", "allOf", "enum", "const"):
        if key in node:
            allowed = {key, "type"} if key in ("enum", "const") else {key}
            others = [k for k in constraints if k not in allowed]
            if others:
                raise _refuse(path, others[0], f"the grammar ignores it next to {key!r}")
    _check_details(node, path, types)
    if "oneOf" in node:
        _check_one_of(node["oneOf"], path, root)


def _types(value: Any, path: str) -> tuple[str, ...]:
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if names is None or not names or any(n not in _JSON_TYPES for n in names):
        raise ValueError(f"{path}.type: expected one of {list(_JSON_TYPES)} or a non-empty list of them, "
                         f"got {value!r}")
    return tuple(names)


def _check_details(node: Mapping[str, Any], path: str, types: tuple[str, ...]) -> None:
    ref = node.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/"))):
        raise ValueError(f"{path}.$ref: only local references ('#' or '#/...') are supported, got {ref!r}")
    if "allOf" in node and (not isinstance(node["allOf"], list) or len(node["allOf"]) != 1):
        raise _refuse(path, "allOf", "only one subschema is enforced; merge the subschemas into one")
    for key in ("anyOf", "oneOf"):
        if node.get(key) == []:
            raise ValueError(f"{path}.{key}: an empty list accepts no value")
    if node.get("uniqueItems", False) is not False:
        raise _refuse(path, "uniqueItems", "not enforced (only uniqueItems: false is accepted)")
    for key in COUNTS:
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value <= MAX_SCHEMA_COUNT):
            raise ValueError(f"{path}.{key}: expected an int in [0, {MAX_SCHEMA_COUNT}], got {value!r}")
    fmt = node.get("format")
    if fmt is not None and fmt not in ENFORCED_FORMATS:
        raise _refuse(path, "format", f"format {fmt!r} is not enforced; enforced: {sorted(ENFORCED_FORMATS)}")
    for first, second in (("format", "pattern"), ("format", "minLength"), ("format", "maxLength"),
                          ("pattern", "minLength"), ("pattern", "maxLength")):
        if first in node and second in node:
            raise _refuse(path, second, f"the grammar ignores it next to {first!r}")
    if "multipleOf" in node and "number" in types:
        raise _refuse(path, "multipleOf", "enforced for integers only")
    values = [node["const"]] if "const" in node else node.get("enum") if "enum" in node else None
    if types and isinstance(values, list):
        for v in values:
            if not any(isinstance(v, _JSON_TYPES[t]) and not (isinstance(v, bool) and t in ("integer", "number"))
                       for t in types):
                raise ValueError(f"{path}: enum/const value {v!r} is not of type {list(types)}")
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list):
        known = props if isinstance(props, Mapping) else {}
        missing = [r for r in required if r not in known]
        if missing:
            raise ValueError(f"{path}.required: {missing[0]!r} is not in properties (the grammar cannot require a "
                             "property it does not describe)")


def _check_one_of(branches: Any, path: str, root: Any) -> None:
    """The grammar enforces oneOf as anyOf; that is exact when no value can match two branches. Proven disjoint:
    branches of disjoint JSON types (from ``type`` or ``const``/``enum`` values), ``const``/``enum`` branches
    without a common value, or objects that require one
    property with disjoint ``const``/``enum`` values (a discriminator, as pydantic writes tagged unions)."""
    if not isinstance(branches, list):
        return
    resolved = [_resolve_ref(b, root) for b in branches]
    for i, a in enumerate(resolved):
        for j in range(i):
            if not _disjoint(a, resolved[j], root):
                raise _refuse(path, "oneOf", f"branches {j} and {i} may both match (the grammar enforces oneOf as "
                                             "anyOf); use anyOf, or tell them apart by type or a required const")


def _resolve_ref(schema: Any, root: Any) -> Any:
    for _ in range(8):
        ref = schema.get("$ref") if isinstance(schema, Mapping) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return schema
        target: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, Mapping) else None
        schema = target
    return schema


def _json_types(schema: Mapping[str, Any]) -> set[str] | None:
    """The JSON types a schema admits (integer counted as number), or None when not known."""
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return {_json_type(v) for v in values}
    t = schema.get("type")
    names = [t] if isinstance(t, str) else t if isinstance(t, list) else None
    return None if names is None else {"number" if n == "integer" else n for n in names}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "null")


def _values(schema: Any) -> list | None:
    if not isinstance(schema, Mapping):
        return None
    return [schema["const"]] if "const" in schema else schema.get("enum") if isinstance(schema.get("enum"), list) \
        else None


def _same(a: Any, b: Any) -> bool:
    return _json_type(a) == _json_type(b) and a == b


def _disjoint(a: Any, b: Any, root: Any) -> bool:
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        return False
    ta, tb = _json_types(a), _json_types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    if _no_common_value(_values(a), _values(b)):
        return True
    pa, pb = a.get("properties"), b.get("properties")
    if not isinstance(pa, Mapping) or not isinstance(pb, Mapping):
        return False
    required = set(a.get("required") or ()) & set(b.get("required") or ())
    for key in required & set(pa) & set(pb):
        if _no_common_value(_values(_resolve_ref(pa[key], root)), _values(_resolve_ref(pb[key], root))):
            return True
    return False


def _no_common_value(va: list | None, vb: list | None) -> bool:
    return va is not None and vb is not None and not any(_same(x, y) for x in va for y in vb)
