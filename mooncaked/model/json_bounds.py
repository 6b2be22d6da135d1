"""Numbers of bounded length in constrained JSON: a JSON schema rewritten so that every number it lets a model write
ends within a few tokens (docs/api.md#structured-outputs).

JSON's number grammar has no length limit, and llguidance has no option for one: a small or unsure model under a
schema (a tool call's arguments with tool_choice `required`) may write digits until max_tokens and leave the
document unclosed. `bound_numbers(schema)` returns a copy in which:

1. every subschema that may match a number (its `type` names number or integer, or it has none) gets
   `minimum` / `maximum` of -/+ MAX_MAGNITUDE where it has no bound of its own (its own are narrowed to them), and
   a number (not integer) gets `multipleOf` MIN_STEP where it has none: at most MAX_INTEGER_DIGITS digits before
   the point, MAX_FRACTION_DIGITS after it, and no exponent;
2. a value the schema leaves open (a `true` subschema, an object's absent `additionalProperties`, an array's
   absent `items`) becomes a reference to ANY_DEF, "any JSON value" with those number bounds at every depth.

Every document the rewritten schema accepts is accepted by the original (it only narrows numbers), so answers
still validate against what the client sent. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_INTEGER_DIGITS = 15
MAX_FRACTION_DIGITS = 9  # llguidance takes a multipleOf of at most 10 fraction digits
MAX_MAGNITUDE = 10**MAX_INTEGER_DIGITS - 1
MIN_STEP = float(f"1e-{MAX_FRACTION_DIGITS}")  # not 10.0 ** -9, which is 1.0000000000000002e-09
ANY_DEF = "mooncaked_bounded_value"
_ANY_REF = {"$ref": f"#/$defs/{ANY_DEF}"}
_NUMBER_TYPES = ("number", "integer")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems", "not", "if",
            "then", "else", "contains")
_NOT_PLAIN = ("$ref", "enum", "const", "anyOf", "oneOf", "allOf", "not")  # no bounds of their own are added


def bound_numbers(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `schema` (a root JSON schema) whose numbers are bounded in length; see the module docstring."""
    bounded = _bound(schema)
    assert isinstance(bounded, dict)
    any_value = {**_number_bounds(is_integer=False), "items": _ANY_REF, "additionalProperties": _ANY_REF}
    return {**bounded, "$defs": {**bounded.get("$defs", {}), ANY_DEF: any_value}}


def _number_bounds(is_integer: bool) -> dict[str, Any]:
    bounds: dict[str, Any] = {"minimum": -MAX_MAGNITUDE, "maximum": MAX_MAGNITUDE}
    return bounds if is_integer else {**bounds, "multipleOf": MIN_STEP}


def _bound(schema: Any) -> Any:
    if schema is True:
        return dict(_ANY_REF)
    if not isinstance(schema, Mapping):
        return schema  # false, or a malformed subschema the grammar engine reports
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _bound(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_bound(sub) for sub in out[key]]
    for key in _SCHEMAS:
        if key in out:
            out[key] = _bound(out[key])
    if "items" in out:
        out["items"] = [_bound(sub) for sub in out["items"]] if isinstance(out["items"], list) else _bound(out["items"])
    if any(key in out for key in _NOT_PLAIN):
        return out
    types = out.get("type")
    names = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else None
    if names is None or names & set(_NUMBER_TYPES):
        _narrow(out, is_integer=names is not None and "number" not in names)
    if (names is None or "object" in names) and "unevaluatedProperties" not in out:
        out.setdefault("additionalProperties", dict(_ANY_REF))
    if (names is None or "array" in names) and "unevaluatedItems" not in out:
        out.setdefault("items", dict(_ANY_REF))
    return out


def _narrow(schema: dict[str, Any], is_integer: bool) -> None:
    """Bounds within -/+ MAX_MAGNITUDE (a schema's own kept where tighter; left as they are where they lie
    outside) and, for a number, a step (its own kept)."""
    low = max(_as_number(schema.get("minimum"), -MAX_MAGNITUDE), -MAX_MAGNITUDE)
    high = min(_as_number(schema.get("maximum"), MAX_MAGNITUDE), MAX_MAGNITUDE)
    if low <= high:
        schema["minimum"], schema["maximum"] = low, high
    if not is_integer:
        schema.setdefault("multipleOf", MIN_STEP)


def _as_number(value: Any, default: float) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default
