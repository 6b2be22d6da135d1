"""Encoding of wire messages (versioned frozen dataclasses) in two msgpack-ready forms, and back.

  map form:   {"v": VERSION, field name: value, ...}   (encode_message / decode_message)
  array form: [VERSION, value, ...] in field order      (encode_array / decode_array)
The RPC layer carries requests and replies in the array form (no keys to pack, unpack and look up on every
call); the map form is for everything else. Nested messages take the form of their parent.

Lifecycle of a message type's codec:
  1. The first encode or decode of a class builds its codec from the dataclass's type hints: generated
     encoders and decoders for both forms (one line per field, as dataclasses generates __init__) plus a
     general checked path.
  2. encode: the field values plus the class VERSION; nested messages are encoded in the same form.
  3. decode: a complete, well-typed value is checked inline; anything else takes _decode_checked, which fills
     defaults of absent fields (in the array form: trailing ones) or raises ProtocolError naming the field at
     fault (or the version mismatch).
Field types are those of mooncaked.rpc.codec_fields.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, TypeVar, cast

from mooncaked.rpc.codec_fields import (EXACT_TYPES, FieldDecoder, FieldEncoder, NestedDecode, ProtocolError, fail,
                                        field_decoder, field_encoder, is_message)

__all__ = ["ProtocolError", "array_decoder_for", "array_encoder_for", "decode_array", "decode_message",
           "decoder_for", "encode_array", "encode_message", "encoder_for"]

M = TypeVar("M")
_FieldRow = tuple[str, "type | None", FieldDecoder, Any]  # name, exact type or None, decoder, default factory


def encode_message(msg: Any) -> dict[str, Any]:
    """The map form of `msg` (field names as keys, plus "v": the class VERSION)."""
    return (_CODECS.get(type(msg)) or _codec_for(type(msg))).encode(msg)


def decode_message(cls: type[M], data: Any) -> M:
    """The message of type `cls` in the map form `data`; ProtocolError naming the fault when it does not fit."""
    return cast(M, (_CODECS.get(cls) or _codec_for(cls)).decode(data))


def encode_array(msg: Any) -> list[Any]:
    """The array form of `msg`: [VERSION, field values in declaration order]."""
    return (_CODECS.get(type(msg)) or _codec_for(type(msg))).encode_array(msg)


def decode_array(cls: type[M], data: Any) -> M:
    """The message of type `cls` in the array form `data` (trailing fields with defaults may be absent)."""
    return cast(M, (_CODECS.get(cls) or _codec_for(cls)).decode_array(data))


def encoder_for(cls: type[M]) -> Callable[[M], dict[str, Any]]:
    """encode_message specialised to `cls`, for hot paths that encode one type many times."""
    return (_CODECS.get(cls) or _codec_for(cls)).encode


def decoder_for(cls: type[M]) -> Callable[[Any], M]:
    """decode_message specialised to `cls` (same checks and errors), for hot paths."""
    return (_CODECS.get(cls) or _codec_for(cls)).decode


def array_encoder_for(cls: type[M]) -> Callable[[M], list[Any]]:
    return (_CODECS.get(cls) or _codec_for(cls)).encode_array


def array_decoder_for(cls: type[M]) -> Callable[[Any], M]:
    return (_CODECS.get(cls) or _codec_for(cls)).decode_array


class _MessageCodec:
    """Per-class encoders and decoders of both forms, built once from the dataclass's type hints.

    They are generated code (as dataclasses generates __init__): with one line per field they cost a third
    of a generic loop over fields, and they sit on every RPC call's path. A decoder hands anything but a
    complete, well-typed value to _decode_checked, which explains the fault.
    """

    def __init__(self, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        self.cls = cls
        self.version: int = getattr(cls, "VERSION")
        self.has_post_init = hasattr(cls, "__post_init__")
        self.names = [f.name for f in fields]
        self.map_rows = _field_rows(cls, hints, fields, decode_message)
        self.array_rows = _field_rows(cls, hints, fields, decode_array)
        self.encode: Callable[[Any], dict[str, Any]] = _generate_encoder(
            self, [field_encoder(hints[name], encode_message) for name in self.names], is_array=False)
        self.encode_array: Callable[[Any], list[Any]] = _generate_encoder(
            self, [field_encoder(hints[name], encode_array) for name in self.names], is_array=True)
        self.decode: Callable[[Any], Any] = _generate_decoder(self, hints, is_array=False)
        self.decode_array: Callable[[Any], Any] = _generate_decoder(self, hints, is_array=True)


def _field_rows(cls: type, hints: dict[str, Any], fields: tuple[dataclasses.Field[Any], ...],
                decode_nested: NestedDecode) -> list[_FieldRow]:
    return [(f.name, hints[f.name] if hints[f.name] in EXACT_TYPES else None,
             field_decoder(hints[f.name], f"{cls.__name__}.{f.name}", decode_nested), _default_of(f))
            for f in fields]


def _decode_checked(codec: _MessageCodec, data: Any, rows: list[_FieldRow]) -> Any:
    """The general map-form decoder: fills defaults of absent fields and names exactly what is wrong."""
    cls = codec.cls
    if type(data) is not dict:
        raise ProtocolError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
    if data.get("v") != codec.version:
        raise ProtocolError(
            f"{cls.__name__}: version {data.get('v')!r} but this build speaks version {codec.version}; "
            "run the same mooncaked version on both ends"
        )
    values: dict[str, Any] = {}
    num_seen = 1
    for name, exact_type, decode, default in rows:
        value = data.get(name, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
            values[name] = default()
            continue
        num_seen += 1
        if exact_type is None:
            values[name] = decode(value, name)
        elif type(value) is exact_type:
            values[name] = value
        else:
            raise fail(f"{cls.__name__}.{name}", exact_type.__name__, value)
    if num_seen != len(data):
        unknown = sorted(str(k) for k in data if k not in values and k != "v")
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {unknown}")
    # Filling __dict__ directly skips the frozen dataclass __init__ (one object.__setattr__ per field,
    # the largest cost on the RPC hot path); __post_init__ validation still runs.
    msg: Any = object.__new__(cls)
    msg.__dict__.update(values)
    if codec.has_post_init:
        msg.__post_init__()
    return msg


def _decode_array_checked(codec: _MessageCodec, data: Any) -> Any:
    """The general array-form decoder: names the map form's fields by position, then checks as it does."""
    cls = codec.cls
    if type(data) is not list and type(data) is not tuple:
        raise ProtocolError(f"{cls.__name__}: expected an array, got {type(data).__name__}")
    if len(data) > len(codec.names) + 1:
        raise ProtocolError(f"{cls.__name__}: {len(data) - 1} values but the message has {len(codec.names)} "
                            "fields; run the same mooncaked version on both ends")
    as_map = dict(zip(["v", *codec.names], data))
    return _decode_checked(codec, as_map, codec.array_rows)


_MISSING: Any = object()


def _generate_encoder(codec: _MessageCodec, encoders: list[FieldEncoder | None],
                      is_array: bool) -> Callable[[Any], Any]:
    namespace: dict[str, Any] = {f"enc_{name}": enc for name, enc in zip(codec.names, encoders) if enc is not None}
    values = [f'values["{name}"]' if enc is None else f'enc_{name}(values["{name}"])'
              for name, enc in zip(codec.names, encoders)]
    if is_array:
        body = f"[{', '.join([repr(codec.version), *values])}]"
    else:
        items = [f'"v": {codec.version!r}'] + [f'"{name}": {value}' for name, value in zip(codec.names, values)]
        body = "{" + ", ".join(items) + "}"
    exec(f"def encode(msg):\n    values = msg.__dict__\n    return {body}\n", namespace)
    return cast(Callable[[Any], Any], namespace["encode"])


def _generate_decoder(codec: _MessageCodec, hints: dict[str, Any], is_array: bool) -> Callable[[Any], Any]:
    """Checks a complete value inline; anything else (absent fields, any doubt) goes to the checked path."""
    slow: Callable[[Any], Any]
    if is_array:
        def slow(data: Any) -> Any:
            return _decode_array_checked(codec, data)
    else:
        def slow(data: Any) -> Any:
            return _decode_checked(codec, data, codec.map_rows)
    namespace: dict[str, Any] = {"cls": codec.cls, "new": object.__new__, "slow": slow}
    lines = ["def decode(data):"] + (_array_unpack_lines(codec) if is_array else _map_unpack_lines(codec))
    for name, exact_type, decode, _ in (codec.array_rows if is_array else codec.map_rows):
        lines += _field_check_lines(name, exact_type, decode, hints[name], namespace)
    lines += ["    msg = new(cls)", "    values = msg.__dict__"]
    lines += [f"    values['{name}'] = x_{name}" for name in codec.names]
    if codec.has_post_init:
        lines.append("    msg.__post_init__()")
    lines.append("    return msg")
    exec("\n".join(lines) + "\n", namespace)
    return cast(Callable[[Any], Any], namespace["decode"])


def _map_unpack_lines(codec: _MessageCodec) -> list[str]:
    lines = [f"    if type(data) is not dict or len(data) != {len(codec.names) + 1}:",
             "        return slow(data)",
             "    try:",
             f"        if data['v'] != {codec.version!r}:",
             "            return slow(data)"]
    lines += [f"        x_{name} = data['{name}']" for name in codec.names]
    return lines + ["    except KeyError:", "        return slow(data)"]


def _array_unpack_lines(codec: _MessageCodec) -> list[str]:
    targets = ", ".join(["version", *(f"x_{name}" for name in codec.names)])
    return [f"    if type(data) is not list or len(data) != {len(codec.names) + 1}:",
            "        return slow(data)",
            f"    {targets}, = data",
            f"    if version != {codec.version!r}:",
            "        return slow(data)"]


def _field_check_lines(name: str, exact_type: type | None, decode: Any, hint: Any,
                       namespace: dict[str, Any]) -> list[str]:
    if exact_type is not None:
        namespace[f"type_{name}"] = exact_type
        return [f"    if type(x_{name}) is not type_{name}:", "        return slow(data)"]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and args[0] in EXACT_TYPES:
        # Inline loop: token id lists ride in many messages, and a call per element would double the cost.
        namespace[f"item_type_{name}"] = args[0]
        return [f"    if type(x_{name}) is not list:", "        return slow(data)",
                f"    for item in x_{name}:", f"        if type(item) is not item_type_{name}:",
                "            return slow(data)"]
    namespace[f"dec_{name}"] = decode
    return [f"    x_{name} = dec_{name}(x_{name}, '{name}')"]


_CODECS: dict[type, _MessageCodec] = {}


def _codec_for(cls: type) -> _MessageCodec:
    if not is_message(cls):
        raise TypeError(f"{cls!r} is not a Message dataclass")
    codec = _CODECS[cls] = _MessageCodec(cls)
    return codec


def _default_of(f: dataclasses.Field[Any]) -> Any:
    """A zero-argument factory of the field's default, or _MISSING when the field is required."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory
    if f.default is not dataclasses.MISSING:
        value = f.default
        return lambda: value
    return _MISSING
