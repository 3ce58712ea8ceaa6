"""StructuredOutputsParams on its own: what it accepts, the errors that name the field, and
the cache key equal constraints share (compilation: tests/engine/test_structured_output.py)."""

import json

import pytest

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import (
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    SamplingParams,
    StructuredOutputsParams,
)

S = StructuredOutputsParams


@pytest.mark.parametrize("kind, value", [
    ("json", {"type": "object"}), ("json", '{"type": "string"}'), ("json", True),
    ("json_object", True), ("regex", "a+"), ("choice", ["x", "y"]), ("grammar", "start: \"a\""),
])
def test_each_kind_alone(kind, value):
    p = S(**{kind: value})
    assert p.kind == kind and p.field_name() == f"structured_outputs.{kind}"


@pytest.mark.parametrize("kinds", [{}, {"regex": "a", "grammar": "b"},
                                   {"json_object": True, "choice": ["a"]}])
def test_exactly_one_kind(kinds):
    with pytest.raises(InvalidRequestError) as e:
        S(**kinds)
    assert e.value.param == "structured_outputs"
    got = ", ".join(k for k in kinds) or "none"
    assert str(e.value) == ("structured_outputs: set exactly one of json, json_object, regex, "
                            f"choice, grammar (got {got})")


@pytest.mark.parametrize("kind, value, why", [
    ("json", "{oops", "the schema is not valid JSON"),
    ("json", 3, "use a JSON schema object"),
    ("json", "[1]", "use a JSON schema object"),
    ("json_object", "yes", "use true"),
    ("choice", [], "use a non-empty list of non-empty strings"),
    ("choice", ["a", ""], "use a non-empty list of non-empty strings"),
    ("choice", "abc", "use a non-empty list of non-empty strings"),
    ("choice", ["a", 1], "use a non-empty list of non-empty strings"),
    ("regex", "", "use a non-empty string"),
    ("grammar", 5, "use a non-empty string"),
])
def test_bad_values_name_the_field(kind, value, why):
    with pytest.raises(InvalidRequestError) as e:
        S(**{kind: value})
    assert e.value.param == f"structured_outputs.{kind}"
    assert str(e.value).startswith(f"structured_outputs.{kind} is invalid: {why}")


def test_bounds():
    S(regex="a" * MAX_CONSTRAINT_CHARS)
    with pytest.raises(InvalidRequestError, match=f"use at most {MAX_CONSTRAINT_CHARS}"):
        S(regex="a" * (MAX_CONSTRAINT_CHARS + 1))
    S(choice=["c"] * MAX_CHOICES)
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_CHOICES} choices"):
        S(choice=["c"] * (MAX_CHOICES + 1))
    big = {"enum": ["x" * 100] * 700}  # under the choice count, over the characters
    with pytest.raises(InvalidRequestError, match="structured_outputs.json is invalid: it is"):
        S(json=big)


def test_a_front_ends_field_is_named_whole():
    p = S(json={"type": "object"}, param="response_format.json_schema")
    assert p.field_name() == p.field_name("json") == "response_format.json_schema"
    with pytest.raises(InvalidRequestError) as e:
        S(json="{", param="tool_choice")
    assert e.value.param == "tool_choice" and str(e.value).startswith("tool_choice is invalid")


def test_equal_constraints_share_a_key():
    schema = {"b": 1, "a": {"type": "object"}}
    assert S(json=schema).key == S(json=json.dumps(schema, indent=2)).key
    assert S(json=schema).key == ("json", json.dumps(schema, sort_keys=True,
                                                     separators=(",", ":")))
    assert S(json=schema).key != S(json=schema, disable_any_whitespace=True).key
    assert S(json=schema, disable_any_whitespace=True).key[0] == "json/compact"
    assert S(choice=["a", "b"]).key == ("choice", '["a", "b"]')
    assert S(choice=["a", "b"]).key != S(choice=["b", "a"]).key
    assert S(json_object=True).key == ("json_object", "")
    assert S(regex="a+").key == ("regex", "a+") != S(grammar="a+").key
    assert S(regex="a", param="x") == S(regex="a")  # the field name is not the constraint


def test_sampling_params_takes_only_the_type():
    so = S(regex="a")
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    assert SamplingParams(structured_outputs=so, temperature=0.5).plain  # one-pass still
    with pytest.raises(InvalidRequestError, match="use a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
