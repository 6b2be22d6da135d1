"""A request's output constraint (structured outputs): OpenAI's `response_format` and vLLM's `guided_*` and
`structured_outputs` fields, read into one `OutputConstraint` (docs/api.md#structured-outputs).

1. `read_constraint(body)` checks the shape of every constraint field and returns the request's one constraint,
   or None; two constraints in one request are a 400 naming the second. Whether the constraint compiles is the
   conductor's question (roles/conductor/grammars.py), answered with a 400 naming `param`.
2. The kinds: `json_schema` (value: the schema as JSON text), `json_object` (any JSON object), `regex`, `choice`
   (value: a JSON list of strings), `grammar` (Lark or GBNF text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncaked.api.errors import invalid_field
from mooncaked.api.fields import check_text, json_type

MAX_CHOICES = 1024
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
JSON_SCHEMA_MEMBERS = frozenset({"name", "schema", "strict", "description"})
STRUCTURED_OUTPUT_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                           "json_object": "json_object"}
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


@dataclass(frozen=True)
class OutputConstraint:
    kind: str  # json_schema, json_object, regex, choice or grammar
    value: str  # the schema's JSON text, the pattern, a JSON list of strings, the grammar ("" for json_object)
    param: str  # the request field it came from: a constraint that does not compile is a 400 naming it


def read_constraint(body: Mapping[str, Any]) -> OutputConstraint | None:
    found = [c for c in (_response_format(body.get("response_format")), _structured_outputs(body)) if c is not None]
    found += [_guided(name, kind, body[name]) for name, kind in GUIDED_FIELDS.items() if body.get(name) is not None]
    if len(found) > 1:
        raise invalid_field(found[1].param, f"only one output constraint per request; {found[0].param} is one "
                            "already")
    return found[0] if found else None


def _response_format(value: object) -> OutputConstraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_field("response_format", f"expected an object with a type, got {json_type(value)}")
    kind = value.get("type")
    allowed_members = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed_members:
        raise invalid_field("response_format.type", f"expected one of {sorted(allowed_members)}, got {kind!r}")
    for key in value:
        if key not in allowed_members[kind]:
            raise invalid_field(f"response_format.{key}", f"not a member of a {kind!r} response format")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint("json_object", "", "response_format")
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise invalid_field(param, f"expected an object with name and schema, got {json_type(spec)}")
    for key in spec:
        if key not in JSON_SCHEMA_MEMBERS:
            raise invalid_field(f"{param}.{key}", f"unrecognized; json_schema takes {sorted(JSON_SCHEMA_MEMBERS)}")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise invalid_field(f"{param}.name", "required: 1 to 64 letters, digits, underscores or dashes")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid_field(f"{param}.strict", f"expected true or false, got {json_type(spec['strict'])}")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise invalid_field(f"{param}.description", f"expected a string, got {json_type(spec['description'])}")
    schema = spec.get("schema")
    if schema is None:
        return OutputConstraint("json_object", "", f"{param}.schema")
    return _schema(schema, f"{param}.schema", is_text_allowed=False)


def _schema(schema: object, param: str, *, is_text_allowed: bool) -> OutputConstraint:
    if isinstance(schema, str) and is_text_allowed:  # vLLM's guided_json may be the schema's JSON text
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid_field(param, f"is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise invalid_field(param, f"expected a JSON Schema object, got {json_type(schema)}")
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise invalid_field(param, "NaN and infinities are not JSON; use finite numbers") from None
    return OutputConstraint("json_schema", check_text(text, param), param)


def _guided(param: str, kind: str, value: object) -> OutputConstraint:
    if kind == "json_schema":
        return _schema(value, param, is_text_allowed=True)
    if kind == "choice":
        if (not isinstance(value, list) or not 1 <= len(value) <= MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise invalid_field(param, f"expected a list of 1 to {MAX_CHOICES} non-empty strings")
        for choice in value:
            check_text(choice, param)
        return OutputConstraint("choice", json.dumps(value, ensure_ascii=False), param)
    if not isinstance(value, str) or not value:
        raise invalid_field(param, f"expected a non-empty string, got {json_type(value)}")
    return OutputConstraint(kind, check_text(value, param), param)


def _structured_outputs(body: Mapping[str, Any]) -> OutputConstraint | None:
    value = body.get("structured_outputs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_field("structured_outputs", f"expected an object, got {json_type(value)}")
    present = {key: item for key, item in value.items() if item is not None and item is not False}
    for key in present:
        if key not in STRUCTURED_OUTPUT_KINDS:
            raise invalid_field(f"structured_outputs.{key}",
                                f"not supported; structured_outputs takes one of {sorted(STRUCTURED_OUTPUT_KINDS)}")
    if len(present) != 1:
        raise invalid_field("structured_outputs", f"set exactly one of {sorted(STRUCTURED_OUTPUT_KINDS)}")
    key, item = next(iter(present.items()))
    if key == "json_object":
        if item is not True:
            raise invalid_field("structured_outputs.json_object", "expected true")
        return OutputConstraint("json_object", "", "structured_outputs.json_object")
    return _guided(f"structured_outputs.{key}", STRUCTURED_OUTPUT_KINDS[key], item)
