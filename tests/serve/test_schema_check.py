"""Which JSON schemas structured output takes (``serve.schema_check``), replayed against xgrammar and ``jsonschema``:
every refused schema has an answer that breaks it (``jsonschema``) and that xgrammar's grammar lets through — the
reason it is refused —, and every taken one has its breaking answers refused by the grammar and its valid ones let
through. A forced tool call's schema is held to the same check (its errors name ``tools``)."""

from __future__ import annotations

import contextlib
import json

import pytest

from gqa.serve.schema_check import MAX_DEPTH, MAX_VALUES, check_schema

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

INT = {"type": "integer"}
OBJ_AB = {"type": "object", "properties": {"a": INT, "b": INT}}

# (keyword refused, schema, an answer that breaks the schema and that xgrammar 0.2's grammar lets through)
REFUSED = [
    ("'allOf' of 2 schemas", {"allOf": [INT, {"minimum": 5}]}, "3"),
    ("'not'", {"type": "integer", "not": {"const": 3}}, "3"),
    ("'if'", {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, "7"),
    ("'dependentRequired'", OBJ_AB | {"dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ("'dependentSchemas'", OBJ_AB | {"dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    ("'uniqueItems'", {"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]"),
    ("'contains'", {"type": "array", "items": INT, "contains": {"const": 5}}, "[1, 2]"),
    ("'\\$ref' '#foo' points outside", {"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, '"x"'),
    ("'\\$ref' 'https://x.org/s#/\\$defs/a' points outside",
     {"$id": "https://x.org/s", "$defs": {"a": INT}, "$ref": "https://x.org/s#/$defs/a"}, '"x"'),
    ("'\\$dynamicRef'", {"$defs": {"a": {"$dynamicAnchor": "m", "type": "integer"}}, "$dynamicRef": "#m"}, '"x"'),
    ("'minimum' beside '\\$ref'", {"$defs": {"a": INT}, "$ref": "#/$defs/a", "minimum": 5}, "1"),
    ("'type' beside 'anyOf'", {"type": "integer", "anyOf": [INT | {"minimum": 5}, {"type": "string"}]}, '"x"'),
    ("'properties' beside 'anyOf'", {"type": "object", "properties": {"a": INT}, "required": ["a"],
                                     "anyOf": [{"properties": {"a": {"minimum": 5}}}]}, '{"a": 1}'),
    ("'maximum' beside 'enum'", {"type": "integer", "enum": [1, 10], "maximum": 5}, "10"),
    ("'maxLength' beside 'const'", {"type": "string", "const": "abcd", "maxLength": 2}, '"abcd"'),
    ("value 1 is not of 'type' 'string'", {"type": "string", "enum": ["a", 1]}, "1"),
    ("'oneOf' whose branches 0 and 1", {"oneOf": [INT, {"type": "number"}]}, "1"),
    ("'oneOf' whose branches 0 and 1", {"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b"]}]}, '"b"'),
    ("'minimum' without a 'type'", {"minimum": 5}, "3"),
    ("'pattern' without a 'type'", {"pattern": "^a$"}, '"b"'),
    ("'maxItems' without a 'type'", {"maxItems": 1}, "[1, 2]"),
    ("'required' without a 'type'", {"required": ["a"]}, "{}"),
    ("'multipleOf' other than", {"type": "number", "multipleOf": 0.5}, "0.3"),
    ("'multipleOf' other than", {"type": "integer", "multipleOf": 3, "minimum": 1}, "4"),
    ("'maxLength' beside 'pattern'", {"type": "string", "pattern": "^a*$", "maxLength": 3}, '"aaaaa"'),
    ("'minLength' beside 'format'", {"type": "string", "format": "date", "minLength": 20}, '"2020-01-01"'),
    ("'pattern' beside 'format'", {"type": "string", "format": "date", "pattern": "^2020"}, '"2021-01-01"'),
    ("'propertyNames' beside 'properties'", {"type": "object", "properties": {"abc": INT},
                                             "propertyNames": {"maxLength": 2}}, '{"abc": 1}'),
    ("'required' names 'a', which 'properties' does not list",
     {"type": "object", "required": ["a"], "additionalProperties": True}, "{}"),
    ("'not' is not supported \\(at '#/items'\\)", {"type": "array", "items": {"type": "integer", "not": {"const": 3}}},
     "[3]"),
    ("'not' is not supported \\(at '#/\\$defs/a'\\)",
     {"$defs": {"a": {"type": "integer", "not": {"const": 3}}}, "type": "object", "properties": {"x": {"$ref":
      "#/$defs/a"}}, "required": ["x"]}, '{"x": 3}'),
]  # fmt: skip

# (schema taken, answers that break it, answers that do not)
TAKEN = [
    ({"$defs": {"a": INT}, "$ref": "#/$defs/a"}, ['"x"'], ["1"]),
    ({"definitions": {"a": INT}, "type": "object", "properties": {"x": {"$ref": "#/definitions/a"}}, "required": ["x"]},
     ['{"x": "s"}'], ['{"x": 2}']),
    ({"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer", "maximum": 3}, "kids": {
      "type": "array", "items": {"$ref": "#/$defs/n"}}}, "required": ["v"]}}, "$ref": "#/$defs/n"},
     ['{"v": 1, "kids": [{"v": 5}]}'], ['{"v": 1, "kids": [{"v": 2, "kids": []}]}']),
    ({"type": "object", "properties": {"n": {"$ref": "#"}}}, ['{"n": 1}'], ['{"n": {}}']),
    ({"$defs": {"A": {"type": "integer", "minimum": 5}}, "type": "object", "required": ["a"],
      "properties": {"a": {"allOf": [{"$ref": "#/$defs/A"}], "description": "one schema: taken"}}},
     ['{"a": 3}'], ['{"a": 7}']),
    ({"anyOf": [INT, {"type": "null"}], "title": "Optional[int]", "default": None}, ['"x"'], ["1", "null"]),
    ({"oneOf": [INT, {"type": "string"}]}, ["true"], ["1", '"a"']),
    ({"oneOf": [{"$ref": "#/$defs/C"}, {"$ref": "#/$defs/D"}], "$defs": {
      "C": {"type": "object", "properties": {"k": {"const": "c", "type": "string"}}, "required": ["k"]},
      "D": {"type": "object", "properties": {"k": {"enum": ["d"]}, "x": INT}, "required": ["k", "x"]}}},
     ['{"k": "e"}', '{"k": "d"}'], ['{"k": "c"}', '{"k": "d", "x": 1}']),
    ({"oneOf": [{"type": "string"}, {"anyOf": [INT, {"type": "null"}]}]}, ["true"], ['"a"', "1", "null"]),
    ({"type": "string", "enum": ["red", "green"], "description": "type and enum agree"}, ['"blue"'], ['"red"']),
    ({"type": ["integer", "string"], "minimum": 5}, ["3"], ["7", '"a"']),
    ({"type": "integer", "multipleOf": 3}, ["4"], ["6"]),
    ({"type": "number", "exclusiveMaximum": 3.5, "minimum": 1}, ["3.5", "0.5"], ["3"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"a"', '"abcd"'], ['"ab"']),
    ({"type": "string", "pattern": "^a+$"}, ['"b"'], ['"aa"']),
    ({"type": "array", "prefixItems": [INT], "items": {"type": "string"}, "maxItems": 2}, ['[1, "a", "b"]', '["a"]'],
     ['[1, "a"]']),
    ({"items": INT, "description": "items: an array"}, ['["x"]'], ["[1]"]),
    ({"type": "object", "additionalProperties": True, "propertyNames": {"maxLength": 1}}, ['{"ab": 1}'], ['{"a": 1}']),
    ({"type": "object", "properties": {"a": INT}, "additionalProperties": {"type": "string", "maxLength": 2}},
     ['{"a": 1, "b": "xyz"}'], ['{"a": 1, "b": "xy"}']),
    ({"type": "object", "properties": {"a": INT, "b": INT, "c": INT}, "maxProperties": 2}, ['{"a": 1, "b": 2, "c": 3}'],
     ['{"a": 1}']),
    ({"type": "object", "properties": {"a": INT}, "dependentRequired": {}, "$defs": {"unused": {"not": {}}}}, [],
     ['{"a": 1}']),
]  # fmt: skip


def grammar_takes(schema: dict, answer: str) -> bool:
    """Whether xgrammar's grammar for ``schema`` (compiled as the server compiles it) matches ``answer`` whole."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)), terminate_without_stop_token=True)
    return matcher.accept_string(answer) and matcher.is_terminated()


@pytest.mark.parametrize(("keyword", "schema", "answer"), REFUSED)
def test_refused_schemas_are_those_whose_grammar_lets_a_breaking_answer_through(keyword, schema, answer):
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(answer))
    assert grammar_takes(schema, answer), "xgrammar now enforces this: take it (serve.schema_check)"
    with pytest.raises(ValueError, match=keyword):
        check_schema(schema)


@pytest.mark.parametrize(("schema", "breaking", "valid"), TAKEN)
def test_taken_schemas_are_enforced_by_their_grammar(schema, breaking, valid):
    check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for answer in breaking:
        assert not validator.is_valid(json.loads(answer)) and not grammar_takes(schema, answer), answer
    for answer in valid:
        assert validator.is_valid(json.loads(answer)) and grammar_takes(schema, answer), answer


def test_bounds_of_size_and_depth():
    deep: dict = {"type": "integer"}
    for _ in range(MAX_DEPTH):  # each level one JSON level deeper
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match=f"nests deeper than {MAX_DEPTH} levels"):
        check_schema(deep)
    check_schema(deep["items"]["items"])
    with pytest.raises(ValueError, match=f"more than {MAX_VALUES} JSON values"):
        check_schema({"enum": list(range(MAX_VALUES))})
    check_schema({"enum": list(range(MAX_VALUES // 2))})
    with pytest.raises(ValueError, match="'#/\\$defs/nope' at '#/items' points at nothing"):
        check_schema({"type": "array", "items": {"$ref": "#/$defs/nope"}})


KEYWORDS = ["type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf", "properties", "required", "items", "minimum",
            "multipleOf", "pattern", "format", "maxLength", "propertyNames", "$defs", "not", "a"]  # fmt: skip


@pytest.mark.parametrize(
    "schema",
    [
        {"oneOf": [{"type": "object", "required": [[1]]}]},
        {"oneOf": [{"const": 1, "enum": 5}]},
        {"oneOf": [{"type": "object", "required": 5}, {"type": "object"}]},
        {"oneOf": [{"type": "object", "properties": {"a": {"enum": 5}}, "required": ["a"]}, {"type": "string"}]},
    ],
)
def test_malformed_keywords_inside_one_of_are_refused_with_a_value_error(schema):
    """A ``oneOf`` branch's keywords are read to tell branches apart before the branch's own check: a malformed one
    (``required`` not a list of names, ``enum`` not a list) must end in a ``ValueError`` (a 400), not a TypeError."""
    with contextlib.suppress(ValueError):
        check_schema(schema)


def test_any_json_is_taken_or_refused_with_a_value_error():
    """Whatever JSON a client sends as a schema (wrong types under every keyword, refs that loop), the check ends
    with a ``ValueError`` or nothing: never another exception (a 500)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.sampled_from(
        ["#", "#/$defs/a", "#/anyOf/0", "integer", "string", "object", "array", "a", "^a$"])  # fmt: skip
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.sampled_from(KEYWORDS), inner, max_size=4), max_leaves=20)  # fmt: skip

    @hypothesis.settings(max_examples=400, deadline=None, database=None)
    @hypothesis.given(values)
    def check(schema):
        with contextlib.suppress(ValueError):
            check_schema(schema)

    check()
