"""Which JSON schemas structured output takes: what xgrammar enforces, within bounds of size.

xgrammar compiles a schema into a grammar and drops, with at most a log line, what its grammar cannot express: an
answer held to that grammar can break the schema. ``check_schema`` refuses such a schema instead (as vLLM does), naming
the keyword and where it is (a JSON pointer). Each rule was found by compiling a schema with xgrammar 0.2 and matching
strings that break the keyword (``tests/serve/test_schema_check.py`` replays them against ``jsonschema``):

- refused anywhere: ``not``, ``if``/``then``/``else``, ``dependentRequired``/``dependentSchemas``/``dependencies``,
  ``uniqueItems: true``, ``contains``/``minContains``/``maxContains``, ``$dynamicRef``/``$recursiveRef``, and
  ``allOf`` with more than one schema;
- ``$ref`` only into this schema (``#`` or ``#/...``: ``#/$defs/...``, ``#/definitions/...``);
- beside ``$ref``, ``allOf``, ``anyOf``, ``oneOf``, ``enum`` or ``const``, no other constraint (annotations — ``title``,
  ``description``, ``default``, ... — are fine, and ``type`` beside ``enum``/``const`` when every value has it);
- ``oneOf`` only where no value can match two branches (they differ in type, in ``const``/``enum`` values, or in the
  ``const``/``enum`` of a property both require): elsewhere xgrammar holds it as ``anyOf``;
- a type's own keywords (``minimum``, ``maxLength``, ``pattern``, ``minItems``, ``required``, ...) only with a ``type``
  (``properties`` or ``additionalProperties`` make it an object, ``items`` or ``prefixItems`` an array);
  ``multipleOf`` only on ``"type": "integer"`` without ``minimum``/``maximum``; one of ``format``, ``pattern`` and
  ``minLength``/``maxLength``; ``propertyNames`` not beside ``properties``; ``required`` only of names ``properties``
  lists.

Only what the root reaches is checked (an unused ``$defs`` entry is not). Bounds: ``MAX_VALUES`` JSON values (every
object, array, string, number, ...) nested at most ``MAX_DEPTH`` deep; the compile time grows with both.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_VALUES", "check_schema"]

MAX_VALUES = 10_000  # compiling 10,000 values (3,000 properties, or an enum of 10,000) takes ~1-3 s on one core
MAX_DEPTH = 64  # JSON nesting: ~30 levels of nested objects
MAX_ONE_OF = 100  # a oneOf's branches (each pair is shown not to overlap)

REFUSED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
DEPENDENT = ("dependentRequired", "dependentSchemas", "dependencies")  # refused unless empty (then they ask nothing)
# the keywords that constrain a value (the rest are annotations: title, description, default, examples, $defs, ...)
CONSTRAINTS = {
    "type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf", "format",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties",
    "maxProperties", "unevaluatedProperties", "items", "prefixItems", "minItems", "maxItems", "unevaluatedItems",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern",
}  # fmt: skip
# the keywords no other constraint may stand beside (xgrammar keeps the one, drops the others)
ALONE = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")
# a type's own keywords: xgrammar enforces them only where the schema says (or implies) that type
RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
TYPED = {
    **dict.fromkeys((*RANGE, "multipleOf"), frozenset({"integer", "number"})),
    **dict.fromkeys(("minLength", "maxLength", "pattern"), frozenset({"string"})),
    **dict.fromkeys(("minItems", "maxItems"), frozenset({"array"})),
    **dict.fromkeys(("required", "minProperties", "maxProperties", "propertyNames"), frozenset({"object"})),
}
IMPLIED = {"properties": "object", "additionalProperties": "object", "items": "array", "prefixItems": "array"}
SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems")
SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf", "allOf")


def check_schema(schema: Any) -> None:
    """``ValueError`` naming what xgrammar would not enforce in ``schema`` (a decoded JSON schema) and where, or the
    bound it exceeds."""
    _check_size(schema)
    todo, seen = [(schema, "#", set())], set()  # (subschema, where, the types its place implies)
    while todo:  # a loop, not recursion: $ref chains may be long
        node, where, implied = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        _check_keywords(node, where, implied, schema)
        if isinstance(node.get("$ref"), str):
            todo.append((_resolve(schema, node["$ref"], where), node["$ref"], set()))
        for key in ("properties", "patternProperties"):
            if isinstance(node.get(key), dict):
                todo += [(sub, f"{where}/{key}/{_escape(name)}", set()) for name, sub in node[key].items()]
        todo += [(node[key], f"{where}/{key}", set()) for key in SUBSCHEMA if key in node]
        if "propertyNames" in node:  # a property's name is a string: its schema need not say so
            todo.append((node["propertyNames"], f"{where}/propertyNames", {"string"}))
        for key in SUBSCHEMAS:
            if isinstance(node.get(key), list):
                todo += [(sub, f"{where}/{key}/{i}", set()) for i, sub in enumerate(node[key])]


def _check_size(schema: Any) -> None:
    values, todo = 0, [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        values += 1
        if values > MAX_VALUES:
            raise ValueError(f"the schema has more than {MAX_VALUES} JSON values: make it smaller")
        if depth > MAX_DEPTH:
            raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels: make it flatter")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        todo += [(child, depth + 1) for child in children]


def _check_keywords(node: dict, where: str, implied: set[str], root: Any) -> None:
    def refuse(why: str) -> ValueError:
        return ValueError(f"{why} (at '{where}'): xgrammar would not enforce it, so answers could break the schema")

    for key in REFUSED + DEPENDENT:
        if key in node and (key in REFUSED or node[key]):
            raise refuse(f"'{key}' is not supported")
    if node.get("uniqueItems") is True:
        raise refuse("'uniqueItems' is not supported")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise refuse(f"'$ref' {ref!r} points outside the schema ('#/$defs/...' is supported)")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise refuse(f"'allOf' of {len(node['allOf'])} schemas (merge them into one)")
    constraints = CONSTRAINTS.intersection(node)
    for key in ALONE:
        others = sorted(constraints - {key, "type"} if key in ("enum", "const") else constraints - {key})
        if key in node and others:
            raise refuse(f"'{others[0]}' beside '{key}'")
    if "type" in node and ("enum" in node or "const" in node):
        values = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else []
        for value in values:
            if not any(_has_type(value, t) for t in _types(node["type"])):
                raise refuse(f"the 'enum'/'const' value {value!r} is not of 'type' {node['type']!r}")
    kinds = _types(node["type"]) if "type" in node else {IMPLIED[k] for k in IMPLIED if k in node} or implied
    for key, needs in TYPED.items():
        if key in node and not needs & kinds:
            raise refuse(f"'{key}' without a 'type' of {' or '.join(sorted(needs))}")
    if "multipleOf" in node:
        whole = isinstance(node["multipleOf"], int) and not isinstance(node["multipleOf"], bool)
        if kinds != {"integer"} or not whole or any(k in node for k in RANGE):
            raise refuse("'multipleOf' other than a whole number on an integer without a range")
    strings = [k for k in ("format", "pattern", "minLength", "maxLength") if k in node]  # xgrammar keeps the first
    if len(strings) > 1 and strings[:2] != ["minLength", "maxLength"]:
        raise refuse(f"'{strings[1]}' beside '{strings[0]}'")
    if "propertyNames" in node and ("properties" in node or "patternProperties" in node):
        raise refuse("'propertyNames' beside 'properties' (xgrammar lets the listed names break it)")
    if isinstance(node.get("required"), list):
        listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in node["required"] if not (isinstance(name, str) and name in listed)]
        if missing:
            raise refuse(f"'required' names {missing[0]!r}, which 'properties' does not list")
    branches = node.get("oneOf")
    if isinstance(branches, list):
        if len(branches) > MAX_ONE_OF:  # each pair is compared
            raise refuse(f"'oneOf' of more than {MAX_ONE_OF} schemas (use 'anyOf')")
        facts = [_facts(_resolved(root, b), root) for b in branches]
        for i in range(len(facts)):
            for j in range(i):
                if not _disjoint(facts[i], facts[j]):
                    raise refuse(f"'oneOf' whose branches {j} and {i} may both match (use 'anyOf')")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _resolve(root: Any, ref: str, where: str) -> Any:
    """The subschema ``ref`` (``#`` or a JSON pointer ``#/...``) names in ``root``."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"'$ref' {ref!r} at '{where}' points at nothing in the schema")
    return node


def _resolved(root: Any, node: Any, hops: int = 32) -> Any:
    """``node`` after following its ``$ref`` (a chain of them, up to ``hops``); ``None`` where that does not end."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and hops:
        node, hops = _resolve(root, node["$ref"], node["$ref"]), hops - 1
    return node if hops else None


def _types(t: Any) -> set[str]:
    """The type names a ``type`` keyword gives."""
    return {name for name in (t if isinstance(t, list) else [t]) if isinstance(name, str)}


def _has_type(value: Any, t: str) -> bool:
    if t == "integer":
        return _kind(value) == "number" and (isinstance(value, int) or value.is_integer())
    return _kind(value) == t


def _kind(value: Any) -> str:
    """A JSON value's type, "number" for integers too (what two schemas' types overlap on)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    kinds = {int: "number", float: "number", str: "string", list: "array", dict: "object"}
    return next(name for cls, name in kinds.items() if isinstance(value, cls))


def _values(node: Any) -> set | None:
    """The values a schema allows, when a ``const``/``enum`` of scalars lists them (comparable across types: 1 equals
    1.0, not true); ``None`` otherwise."""
    if not isinstance(node, dict) or not ("const" in node or isinstance(node.get("enum"), list)):
        return None
    values = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]]
    if any(isinstance(v, (dict, list)) or (isinstance(v, float) and not math.isfinite(v)) for v in values):
        return None
    return {(_kind(v), v) for v in values}  # (as Python compares numbers: 1 == 1.0)


def _facts(node: Any, root: Any, depth: int = 0) -> tuple[set[str] | None, set | None, dict[str, set]]:
    """What tells a ``oneOf`` branch apart: the types it allows (``None``: any), its values (``_values``) and, for an
    object, the values of each property it requires whose values are listed. ``depth``: anyOfs looked into."""
    if node is False:
        return set(), set(), {}
    values = _values(node)
    if values is not None:
        return {kind for kind, _ in values}, values, {}
    if not isinstance(node, dict):
        return None, None, {}
    if "type" in node:
        kinds = {"number" if t == "integer" else t for t in _types(node["type"])}
    elif isinstance(node.get("anyOf"), list) and depth < 8:  # the types its branches allow
        branches = [_facts(_resolved(root, b), root, depth + 1)[0] for b in node["anyOf"]]
        kinds = None if None in branches else set().union(*branches)
    else:
        kinds = {IMPLIED[k] for k in IMPLIED if k in node} or None
    keys = {}
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if kinds == {"object"} and isinstance(node.get("required"), list) else ()
    for name in required:
        if isinstance(name, str) and name in properties:
            listed = _values(_resolved(root, properties[name]))
            if listed is not None:
                keys[name] = listed
    return kinds, None, keys


def _disjoint(a: tuple, b: tuple) -> bool:
    """Whether no value matches both branches (by ``_facts``; ``False`` where that cannot be shown)."""
    (kinds_a, values_a, keys_a), (kinds_b, values_b, keys_b) = a, b
    if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
        return True
    if values_a is not None and values_b is not None:
        return not values_a & values_b
    return any(not keys_a[name] & keys_b[name] for name in keys_a.keys() & keys_b.keys())
