"""Hypothesis strategies for the JSON schemas agents send (nested objects, arrays, enums, bounded numbers), bounded
so that any model, even a random one, finishes an answer within a few hundred tokens: numbers are multiples of a
power of two (a random model would otherwise write fraction digits until max_tokens; a power of two keeps
jsonschema's multipleOf check exact), strings and arrays have a maximum length."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

names = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
enum_values = st.one_of(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6),
                        st.integers(-50, 50), st.booleans())


@st.composite
def bounded(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    lo = draw(st.integers(-1000, 1000))
    hi = draw(st.integers(lo, lo + 2000))
    schema: dict[str, Any] = {"type": kind, "minimum": lo, "maximum": hi}
    if kind == "number":
        schema["multipleOf"] = draw(st.sampled_from([0.5, 0.25, 0.125]))
    return schema


leaves = st.one_of(
    bounded("integer"), bounded("number"), st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.lists(enum_values, min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
)


def arrays(items: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
                     items, st.integers(0, 1), st.integers(0, 2))


@st.composite
def objects_of(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    properties = draw(st.dictionaries(names, children, max_size=4))
    required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True)) if properties else []
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def json_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """A top-level object schema of nested objects, arrays, enums, bounded numbers and short strings."""
    values = st.recursive(leaves, lambda children: arrays(children) | objects_of(children), max_leaves=8)
    return objects_of(values)
