"""Output constraints as requests spell them (api/structured.py): each form read into one constraint, and each bad
shape a 400 naming the member at fault."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mooncaked.api.errors import ApiError
from mooncaked.api.structured import OutputConstraint, read_constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("body", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, OutputConstraint("json_object", "", "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x_1", "schema": SCHEMA, "strict": True}}},
     OutputConstraint("json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     OutputConstraint("json_object", "", "response_format.json_schema.schema")),
    ({"guided_json": SCHEMA}, OutputConstraint("json_schema", json.dumps(SCHEMA), "guided_json")),
    ({"guided_json": json.dumps(SCHEMA)}, OutputConstraint("json_schema", json.dumps(SCHEMA), "guided_json")),
    ({"guided_regex": "a+"}, OutputConstraint("regex", "a+", "guided_regex")),
    ({"guided_choice": ["a", "b"]}, OutputConstraint("choice", '["a", "b"]', "guided_choice")),
    ({"guided_grammar": 'start: "x"'}, OutputConstraint("grammar", 'start: "x"', "guided_grammar")),
    ({"structured_outputs": {"json": SCHEMA, "regex": None}},
     OutputConstraint("json_schema", json.dumps(SCHEMA), "structured_outputs.json")),
    ({"structured_outputs": {"json_object": True}},
     OutputConstraint("json_object", "", "structured_outputs.json_object")),
])
def test_each_form_reads_into_one_constraint(body: dict[str, Any], expected: OutputConstraint | None) -> None:
    assert read_constraint(body) == expected


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": 1}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"a": float("nan")}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": 5}, "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_a_bad_shape_is_a_400_naming_the_member(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        read_constraint(body)
    assert raised.value.status == 400 and raised.value.param == param
