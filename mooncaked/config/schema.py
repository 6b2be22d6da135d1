"""Generic building of frozen dataclasses from plain YAML data, with every error collected.

1. `build(cls, data, path, errors)` walks a dataclass's fields, converting and checking each value against its
   type hint and its `field(metadata=...)` bounds (`min`, `max`, `choices`).
2. Unknown keys are errors that suggest the nearest valid key; missing keys take the field's default.
3. Errors are appended as `ConfigIssue(path, message)`; nothing raises until the caller decides to.

Only the types the config uses are supported: bool, int, float, str, Optional[T], list[T], tuple[T, ...],
dict[str, T], Literal[...] and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")
_MISSING = object()


@dataclass(frozen=True)
class ConfigIssue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.message}"


def bounded(default: Any, *, min: float | None = None, max: float | None = None,
            choices: tuple[Any, ...] | None = None, doc: str = "") -> Any:
    """A dataclass field with range/choice metadata checked by `build`."""
    meta = {"min": min, "max": max, "choices": choices, "doc": doc}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def build(cls: type[T], data: Any, path: str, errors: list[ConfigIssue]) -> T | None:
    """Build `cls` from a mapping; returns None (with errors appended) when it cannot."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(ConfigIssue(path, f"expected a mapping, got {type(data).__name__}"))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            errors.append(ConfigIssue(_join(path, str(key)), "unknown key" + _suggest(str(key), list(fields))))
    values: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            values[name] = convert(hints[name], data[name], _join(path, name), errors, field.metadata)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            errors.append(ConfigIssue(_join(path, name), "required key is missing"))
    if any(v is _MISSING for v in values.values()) or _has_missing_required(fields, data):
        return None
    return cls(**values)


def _has_missing_required(fields: dict[str, dataclasses.Field[Any]], data: dict[str, Any]) -> bool:
    return any(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and n not in data
        for n, f in fields.items()
    )


def convert(hint: Any, value: Any, path: str, errors: list[ConfigIssue],
            metadata: typing.Mapping[str, Any] | None = None) -> Any:
    """Convert one value to `hint`, appending an issue and returning _MISSING on failure."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return _convert_optional(args, value, path, errors, metadata)
    if origin is Literal:
        if value not in args:
            errors.append(ConfigIssue(path, f"must be one of {list(args)}, got {value!r}"
                                      + _suggest(str(value), [str(a) for a in args])))
            return _MISSING
        return value
    if origin in (list, tuple):
        return _convert_sequence(origin, args, value, path, errors)
    if origin is dict:
        return _convert_dict(args, value, path, errors)
    if dataclasses.is_dataclass(hint):
        built = build(hint, value, path, errors)  # type: ignore[arg-type,type-var]
        return _MISSING if built is None else built
    return _convert_scalar(hint, value, path, errors, metadata or {})


def _convert_optional(args: tuple[Any, ...], value: Any, path: str, errors: list[ConfigIssue],
                      metadata: typing.Mapping[str, Any] | None) -> Any:
    if value is None and type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    assert len(inner) == 1, f"only Optional[T] unions are supported, got {args}"
    return convert(inner[0], value, path, errors, metadata)


def _convert_sequence(origin: Any, args: tuple[Any, ...], value: Any, path: str,
                      errors: list[ConfigIssue]) -> Any:
    if not isinstance(value, (list, tuple)):
        errors.append(ConfigIssue(path, f"expected a list, got {type(value).__name__}"))
        return _MISSING
    item_hint = args[0] if args else Any
    items = [convert(item_hint, v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if any(i is _MISSING for i in items):
        return _MISSING
    return tuple(items) if origin is tuple else items


def _convert_dict(args: tuple[Any, ...], value: Any, path: str, errors: list[ConfigIssue]) -> Any:
    if not isinstance(value, dict):
        errors.append(ConfigIssue(path, f"expected a mapping, got {type(value).__name__}"))
        return _MISSING
    value_hint = args[1] if len(args) == 2 else Any
    out = {str(k): convert(value_hint, v, _join(path, str(k)), errors) for k, v in value.items()}
    return _MISSING if any(v is _MISSING for v in out.values()) else out


def _convert_scalar(hint: Any, value: Any, path: str, errors: list[ConfigIssue],
                    metadata: typing.Mapping[str, Any]) -> Any:
    converted = _coerce(hint, value)
    if converted is _MISSING:
        errors.append(ConfigIssue(path, f"expected {getattr(hint, '__name__', hint)}, got {value!r}"))
        return _MISSING
    problem = _check_bounds(converted, metadata)
    if problem:
        errors.append(ConfigIssue(path, problem))
        return _MISSING
    return converted


def _coerce(hint: Any, value: Any) -> Any:
    if hint is Any:
        return value
    if hint is bool:
        return value if isinstance(value, bool) else _MISSING
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISSING
    if hint is float:
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if is_number else _MISSING
    if hint is str:
        return value if isinstance(value, str) else _MISSING
    raise TypeError(f"unsupported config type {hint!r}")


def _check_bounds(value: Any, metadata: typing.Mapping[str, Any]) -> str | None:
    low, high, choices = metadata.get("min"), metadata.get("max"), metadata.get("choices")
    if choices is not None and value not in choices:
        return f"must be one of {list(choices)}, got {value!r}" + _suggest(str(value), [str(c) for c in choices])
    if low is not None and value < low:
        return f"must be >= {low}, got {value!r}"
    if high is not None and value > high:
        return f"must be <= {high}, got {value!r}"
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def suggest(word: str, candidates: list[str]) -> str:
    """' (did you mean X?)' for the closest candidate, or ''."""
    return _suggest(word, candidates)
