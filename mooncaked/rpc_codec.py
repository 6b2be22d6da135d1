"""Encoding of wire messages (versioned frozen dataclasses) to msgpack-ready dicts and back.

Lifecycle of a message type's codec:
  1. The first encode or decode of a class builds its codec from the dataclass's type hints: a generated
     encoder and decoder (one line per field, as dataclasses generates __init__) plus a general checked path.
  2. encode: the field dict plus "v", the class VERSION; nested messages become nested dicts.
  3. decode: a complete, well-typed dict is checked inline; anything else takes _decode_checked, which fills
     defaults of absent fields or raises ProtocolError naming the field at fault (or the version mismatch).

Supported field types: int, float (accepts int), str, bytes, bool, None, Any, list[X], tuple[X, ...],
dict[str, X], Optional[X] and nested message dataclasses (without slots=True).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, TypeVar, cast

M = TypeVar("M")
_Codec = Callable[[Any], Any]


class ProtocolError(ValueError):
    """A dict that does not decode to the expected message (wrong version, field or type)."""


def _is_message(value: Any) -> bool:
    return isinstance(value, type) and dataclasses.is_dataclass(value) and isinstance(
        getattr(value, "VERSION", None), int)


def encode_message(msg: Any) -> dict[str, Any]:
    """The msgpack-ready dict of `msg` (field names as keys, plus "v": the class VERSION)."""
    codec = _CODECS.get(type(msg)) or _codec_for(type(msg))
    return codec.encode(msg)


def decode_message(cls: type[M], data: Any) -> M:
    """The message of type `cls` in `data`; ProtocolError naming the fault when it does not fit."""
    codec = _CODECS.get(cls) or _codec_for(cls)
    return cast(M, codec.decode(data))


def encoder_for(cls: type[M]) -> Callable[[M], dict[str, Any]]:
    """encode_message specialised to `cls`, for hot paths that encode one type many times."""
    return (_CODECS.get(cls) or _codec_for(cls)).encode


def decoder_for(cls: type[M]) -> Callable[[Any], M]:
    """decode_message specialised to `cls` (same checks and errors), for hot paths."""
    return (_CODECS.get(cls) or _codec_for(cls)).decode


def _decode_checked(cls: type[M], codec: _MessageCodec, data: Any) -> M:
    """The general decoder: fills defaults of absent fields and names exactly what is wrong."""
    if type(data) is not dict:
        raise ProtocolError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
    if data.get("v") != codec.version:
        raise ProtocolError(
            f"{cls.__name__}: version {data.get('v')!r} but this build speaks version {codec.version}; "
            "run the same mooncaked version on both ends"
        )
    values: dict[str, Any] = {}
    num_seen = 1
    for name, exact_type, decode, default in codec.decoders:
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
            raise _fail(f"{cls.__name__}.{name}", exact_type.__name__, value)
    if num_seen != len(data):
        unknown = sorted(str(k) for k in data if k not in values and k != "v")
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {unknown}")
    # Filling __dict__ directly skips the frozen dataclass __init__ (one object.__setattr__ per field,
    # the largest cost on the RPC hot path); __post_init__ validation still runs.
    msg = object.__new__(cls)
    msg.__dict__.update(values)
    if codec.has_post_init:
        msg.__post_init__()  # type: ignore[attr-defined]
    return msg


_MISSING: Any = object()
_EXACT_TYPES = (int, str, bytes, bool)


class _MessageCodec:
    """Per-class encoder and decoders built once from the dataclass's type hints.

    encode and decode are generated code (as dataclasses generates __init__): with one line per field they
    cost a third of a generic loop over fields, and they sit on every RPC call's path. decode hands anything
    but a complete, well-typed dict to _decode_checked, which explains the fault.
    """

    def __init__(self, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        self.version: int = getattr(cls, "VERSION")
        self.has_post_init = hasattr(cls, "__post_init__")
        encoders = [(f.name, _encoder(hints[f.name])) for f in fields]
        self.decoders = [
            (
                f.name,
                hints[f.name] if hints[f.name] in _EXACT_TYPES else None,
                _decoder(hints[f.name], f"{cls.__name__}.{f.name}"),
                _default_of(f),
            )
            for f in fields
        ]
        self.encode: Callable[[Any], dict[str, Any]] = _generate_encoder(cls, encoders)
        self.decode: Callable[[Any], Any] = _generate_decoder(cls, self, hints)


def _generate_encoder(cls: type, encoders: list[tuple[str, _Codec | None]]) -> Callable[[Any], Any]:
    namespace: dict[str, Any] = {f"enc_{name}": enc for name, enc in encoders if enc is not None}
    items = [f'"v": {getattr(cls, "VERSION")!r}'] + [
        f'"{name}": values["{name}"]' if enc is None else f'"{name}": enc_{name}(values["{name}"])'
        for name, enc in encoders]
    source = f"def encode(msg):\n    values = msg.__dict__\n    return {{{', '.join(items)}}}\n"
    exec(source, namespace)
    return cast(Callable[[Any], Any], namespace["encode"])


def _generate_decoder(cls: type, codec: _MessageCodec, hints: dict[str, Any]) -> Callable[[Any], Any]:
    """Checks a complete dict inline; anything else (absent fields, any doubt) goes to _decode_checked."""
    namespace: dict[str, Any] = {"cls": cls, "new": object.__new__,
                                 "slow": lambda data: _decode_checked(cls, codec, data)}
    names = [name for name, _, _, _ in codec.decoders]
    lines = ["def decode(data):",
             f"    if type(data) is not dict or len(data) != {len(names) + 1}:",
             "        return slow(data)",
             "    try:",
             f"        if data['v'] != {codec.version!r}:",
             "            return slow(data)"]
    lines += [f"        x_{name} = data['{name}']" for name in names]
    lines += ["    except KeyError:", "        return slow(data)"]
    for name, exact_type, decode, _ in codec.decoders:
        lines += _field_check_lines(name, exact_type, decode, hints[name], namespace)
    lines += ["    msg = new(cls)", "    values = msg.__dict__"]
    lines += [f"    values['{name}'] = x_{name}" for name in names]
    if codec.has_post_init:
        lines.append("    msg.__post_init__()")
    lines.append("    return msg")
    exec("\n".join(lines) + "\n", namespace)
    return cast(Callable[[Any], Any], namespace["decode"])


def _field_check_lines(name: str, exact_type: type | None, decode: Any, hint: Any,
                       namespace: dict[str, Any]) -> list[str]:
    if exact_type is not None:
        namespace[f"type_{name}"] = exact_type
        return [f"    if type(x_{name}) is not type_{name}:", "        return slow(data)"]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and args[0] in _EXACT_TYPES:
        # Inline loop: token id lists ride in many messages, and a call per element would double the cost.
        namespace[f"item_type_{name}"] = args[0]
        return [f"    if type(x_{name}) is not list:", "        return slow(data)",
                f"    for item in x_{name}:", f"        if type(item) is not item_type_{name}:",
                "            return slow(data)"]
    namespace[f"dec_{name}"] = decode
    return [f"    x_{name} = dec_{name}(x_{name}, '{name}')"]


_CODECS: dict[type, _MessageCodec] = {}


def _codec_for(cls: type) -> _MessageCodec:
    if not _is_message(cls):
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


def _encoder(hint: Any) -> _Codec | None:
    """None when the value is already msgpack-ready (the common case, kept free of calls)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_message(hint):
        return encode_message
    if origin in (typing.Union, types.UnionType):
        inner = [_encoder(a) for a in args if a is not type(None)]
        if all(e is None for e in inner):
            return None
        return lambda v: encode_message(v) if _is_message(type(v)) else v
    if origin in (list, tuple):
        item = _encoder(args[0]) if args else None
        return None if item is None else (lambda v: [item(x) for x in v])
    if origin is dict:
        value = _encoder(args[1]) if args else None
        return None if value is None else (lambda v: {k: value(x) for k, x in v.items()})
    return None


def _fail(where: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{where}: expected {expected}, got {type(value).__name__}")


def _decoder(hint: Any, where: str) -> Callable[[Any, str], Any]:
    """A function (value, field_name) -> value of type `hint`, raising ProtocolError otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return lambda v, _n: v
    if _is_message(hint):
        return lambda v, _n: decode_message(hint, v)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(args, where)
    if origin is list or origin is tuple:
        return _sequence_decoder(origin, args, where)
    if origin is dict or hint is dict:
        return _dict_decoder(args, where)
    if hint in (int, str, bytes, bool, float, type(None)):
        return _scalar_decoder(hint, where)
    raise TypeError(f"{where}: unsupported wire type {hint!r}")


def _scalar_decoder(hint: type, where: str) -> Callable[[Any, str], Any]:
    if hint is float:
        def decode_float(v: Any, _n: str) -> float:
            if type(v) is float or (type(v) is int):
                return float(v)
            raise _fail(where, "float", v)
        return decode_float

    def decode_exact(v: Any, _n: str) -> Any:
        if type(v) is hint:
            return v
        raise _fail(where, hint.__name__, v)
    return decode_exact


def _union_decoder(args: tuple[Any, ...], where: str) -> Callable[[Any, str], Any]:
    options = [a for a in args if a is not type(None)]
    is_optional = len(options) < len(args)
    if len(options) != 1:
        raise TypeError(f"{where}: only Optional[X] unions are supported on the wire")
    inner = _decoder(options[0], where)

    def decode_optional(v: Any, n: str) -> Any:
        if v is None and is_optional:
            return None
        return inner(v, n)
    return decode_optional


def _sequence_decoder(origin: Any, args: tuple[Any, ...], where: str) -> Callable[[Any, str], Any]:
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        args = args[:1]
    elif origin is tuple and args:
        raise TypeError(f"{where}: only tuple[X, ...] is supported on the wire")
    make = tuple if origin is tuple else list
    if args and args[0] in _EXACT_TYPES:
        return _scalar_sequence_decoder(args[0], make, where)
    item = _decoder(args[0], where + "[]") if args else (lambda v, _n: v)

    def decode_sequence(v: Any, n: str) -> Any:
        if not isinstance(v, (list, tuple)):
            raise _fail(where, "a list", v)
        return make([item(x, n) for x in v])
    return decode_sequence


def _scalar_sequence_decoder(item_type: type, make: type, where: str) -> Callable[[Any, str], Any]:
    """Token id lists ride in many messages: check element types without a call per element."""

    def decode_scalars(v: Any, _n: str) -> Any:
        if type(v) is not list and type(v) is not tuple:
            raise _fail(where, "a list", v)
        for x in v:
            if type(x) is not item_type:
                raise _fail(where + "[]", item_type.__name__, x)
        return v if type(v) is make else make(v)
    return decode_scalars


def _dict_decoder(args: tuple[Any, ...], where: str) -> Callable[[Any, str], Any]:
    value = _decoder(args[1], where + "{}") if args else (lambda v, _n: v)

    def decode_dict(v: Any, n: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise _fail(where, "a map", v)
        if not all(type(k) is str for k in v):
            raise ProtocolError(f"{where}: map keys must be strings")
        return {k: value(x, n) for k, x in v.items()}
    return decode_dict
