"""Per-field codecs of wire messages: one encoder and one checked decoder per field type hint.

Lifecycle: codec.py builds a message class's codec once, asking this module for each field's
  1. encoder: None when the value is already msgpack-ready (the common case, kept free of calls), else a
     function; nested messages go through the `encode_nested` the caller passes (map or array form);
  2. decoder: a function (value, field_name) -> value of the hinted type, raising ProtocolError naming the
     field at fault; nested messages go through `decode_nested` (map or array form).

Supported field types: int, float (accepts int), str, bytes, bool, None, Any, list[X], tuple[X, ...],
dict[str, X], Optional[X] and nested message dataclasses (without slots=True).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable

FieldEncoder = Callable[[Any], Any]
FieldDecoder = Callable[[Any, str], Any]
NestedDecode = Callable[[Any, Any], Any]  # (message class, wire value) -> message

EXACT_TYPES = (int, str, bytes, bool)


class ProtocolError(ValueError):
    """A value that does not decode to the expected message (wrong version, field or type)."""


def is_message(value: Any) -> bool:
    return isinstance(value, type) and dataclasses.is_dataclass(value) and isinstance(
        getattr(value, "VERSION", None), int)


def fail(where: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{where}: expected {expected}, got {type(value).__name__}")


def field_encoder(hint: Any, encode_nested: FieldEncoder) -> FieldEncoder | None:
    """None when values of `hint` are already msgpack-ready."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if is_message(hint):
        return encode_nested
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        inner = field_encoder(options[0], encode_nested) if len(options) == 1 else None
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin in (list, tuple):
        item = field_encoder(args[0], encode_nested) if args else None
        return None if item is None else (lambda v: [item(x) for x in v])
    if origin is dict:
        value = field_encoder(args[1], encode_nested) if args else None
        return None if value is None else (lambda v: {k: value(x) for k, x in v.items()})
    return None


def field_decoder(hint: Any, where: str, decode_nested: NestedDecode) -> FieldDecoder:
    """A function (value, field_name) -> value of type `hint`, raising ProtocolError otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return lambda v, _n: v
    if is_message(hint):
        return lambda v, _n: decode_nested(hint, v)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(args, where, decode_nested)
    if origin is list or origin is tuple:
        return _sequence_decoder(origin, args, where, decode_nested)
    if origin is dict or hint is dict:
        return _dict_decoder(args, where, decode_nested)
    if hint in (int, str, bytes, bool, float, type(None)):
        return _scalar_decoder(hint, where)
    raise TypeError(f"{where}: unsupported wire type {hint!r}")


def _scalar_decoder(hint: type, where: str) -> FieldDecoder:
    if hint is float:
        def decode_float(v: Any, _n: str) -> float:
            if type(v) is float or (type(v) is int):
                return float(v)
            raise fail(where, "float", v)
        return decode_float

    def decode_exact(v: Any, _n: str) -> Any:
        if type(v) is hint:
            return v
        raise fail(where, hint.__name__, v)
    return decode_exact


def _union_decoder(args: tuple[Any, ...], where: str, decode_nested: NestedDecode) -> FieldDecoder:
    options = [a for a in args if a is not type(None)]
    is_optional = len(options) < len(args)
    if len(options) != 1:
        raise TypeError(f"{where}: only Optional[X] unions are supported on the wire")
    inner = field_decoder(options[0], where, decode_nested)

    def decode_optional(v: Any, n: str) -> Any:
        if v is None and is_optional:
            return None
        return inner(v, n)
    return decode_optional


def _sequence_decoder(origin: Any, args: tuple[Any, ...], where: str, decode_nested: NestedDecode) -> FieldDecoder:
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        args = args[:1]
    elif origin is tuple and args:
        raise TypeError(f"{where}: only tuple[X, ...] is supported on the wire")
    make = tuple if origin is tuple else list
    if args and args[0] in EXACT_TYPES:
        return _scalar_sequence_decoder(args[0], make, where)
    item = field_decoder(args[0], where + "[]", decode_nested) if args else (lambda v, _n: v)

    def decode_sequence(v: Any, n: str) -> Any:
        if not isinstance(v, (list, tuple)):
            raise fail(where, "a list", v)
        return make([item(x, n) for x in v])
    return decode_sequence


def _scalar_sequence_decoder(item_type: type, make: type, where: str) -> FieldDecoder:
    """Token id lists ride in many messages: check element types without a call per element."""

    def decode_scalars(v: Any, _n: str) -> Any:
        if type(v) is not list and type(v) is not tuple:
            raise fail(where, "a list", v)
        for x in v:
            if type(x) is not item_type:
                raise fail(where + "[]", item_type.__name__, x)
        return v if type(v) is make else make(v)
    return decode_scalars


def _dict_decoder(args: tuple[Any, ...], where: str, decode_nested: NestedDecode) -> FieldDecoder:
    value = field_decoder(args[1], where + "{}", decode_nested) if args else (lambda v, _n: v)

    def decode_dict(v: Any, n: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise fail(where, "a map", v)
        if not all(type(k) is str for k in v):
            raise ProtocolError(f"{where}: map keys must be strings")
        return {k: value(x, n) for k, x in v.items()}
    return decode_dict
