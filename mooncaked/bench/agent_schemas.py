"""Hypothesis strategies for the JSON schemas agents send: nested objects, arrays, enums, numbers with bounds
(`mooncaked bench agents` and the structured-output and tool-calling tests draw from them; hypothesis is a dev
dependency, as the benchmarks' clients are).

`json_schemas(is_random_model)`: a top-level object schema. Strings and arrays have a maximum length, so an answer
ends within a few hundred tokens; for a random-weight model (`is_random_model`) numbers are also multiples of a power
of two, or such a model writes fraction digits until max_tokens (a power of two keeps jsonschema's multipleOf check
exact)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

names = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
# assigned characters, as clients write: a grammar forcing an unassigned code point this model's vocabulary cannot
# produce is refused with a 400 (model/grammar.py, tested there), which is no answer to score
enum_values = st.one_of(st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cn"]), max_size=6),
                        st.integers(-50, 50), st.booleans())


@st.composite
def bounded(draw: st.DrawFn, kind: str, is_random_model: bool) -> dict[str, Any]:
    lo = draw(st.integers(-1000, 1000))
    hi = draw(st.integers(lo, lo + 2000))
    schema: dict[str, Any] = {"type": kind, "minimum": lo, "maximum": hi}
    if kind == "number" and is_random_model:
        schema["multipleOf"] = draw(st.sampled_from([0.5, 0.25, 0.125]))
    return schema


def leaves(is_random_model: bool) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        bounded("integer", is_random_model), bounded("number", is_random_model), st.just({"type": "boolean"}),
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


def json_schemas(is_random_model: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    """A top-level object schema of nested objects, arrays, enums, bounded numbers and short strings."""
    values = st.recursive(leaves(is_random_model), lambda children: arrays(children) | objects_of(children),
                          max_leaves=8)
    return objects_of(values)
