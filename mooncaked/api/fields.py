"""Typed readers for JSON request fields: each returns the value or raises a 400 naming the field.

JSON has one number type; Python's `bool` is an `int`. These readers keep them apart: `true` is never a
count, `1.5` is never a token id, and a float field accepts `1`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mooncaked.api.errors import invalid_field


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_str(body: Mapping[str, Any], name: str, default: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise invalid_field(name, f"expected a string, got {json_type(value)}")
    return value


def check_text(text: str, param: str) -> str:
    """`text` if it is valid Unicode; JSON's \\u escapes can carry an unpaired surrogate, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_field(param, f"contains an unpaired surrogate (U+{ord(text[exc.start]):04X}) at character "
                            f"{exc.start}; send valid Unicode text") from None
    return text


def read_bool(body: Mapping[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_field(param or name, f"expected true or false, got {json_type(value)}")
    return value


def read_int(
    body: Mapping[str, Any], name: str, default: int | None, *, lo: int | None = None, hi: int | None = None,
    param: str | None = None,
) -> int | None:
    value = body.get(name)
    field = param or name
    if value is None:
        return default
    if not is_int(value):
        raise invalid_field(field, f"expected an integer, got {json_type(value)}")
    if lo is not None and value < lo:
        raise invalid_field(field, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise invalid_field(field, f"must be <= {hi}, got {value}")
    return int(value)


def read_float(
    body: Mapping[str, Any], name: str, default: float, *, lo: float, hi: float, is_lo_open: bool = False,
    param: str | None = None,
) -> float:
    value = body.get(name)
    field = param or name
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid_field(field, f"expected a number, got {json_type(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond a float's range
        raise invalid_field(field, f"must be {'>' if is_lo_open else '>='} {lo} and <= {hi}") from None
    if number != number or (number <= lo if is_lo_open else number < lo) or number > hi:
        bound = f"> {lo}" if is_lo_open else f">= {lo}"
        raise invalid_field(field, f"must be {bound} and <= {hi}, got {value}")
    return number


def read_stop(body: Mapping[str, Any], max_stop: int) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise invalid_field("stop", f"expected a string or a list of strings, got {json_type(value)}")
    if len(items) > max_stop:
        raise invalid_field("stop", f"at most {max_stop} stop sequences, got {len(items)}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise invalid_field("stop", "every stop sequence must be a non-empty string")
        check_text(item, "stop")
    return tuple(items)


def read_int_list(body: Mapping[str, Any], name: str, max_items: int) -> tuple[int, ...]:
    """A list of at most `max_items` non-negative integers (token ids); () when absent."""
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid_field(name, f"expected a list of token ids, got {json_type(value)}")
    if len(value) > max_items:
        raise invalid_field(name, f"at most {max_items} token ids, got {len(value)}")
    for item in value:
        if not is_int(item) or item < 0:
            raise invalid_field(name, f"token ids must be non-negative integers, got {item!r}")
    return tuple(value)


def read_logit_bias(body: Mapping[str, Any], max_entries: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: an object from token ids (decimal strings) to biases in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid_field("logit_bias", f"expected an object of token id -> bias, got {json_type(value)}")
    if len(value) > max_entries:
        raise invalid_field("logit_bias", f"at most {max_entries} entries, got {len(value)}")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise invalid_field("logit_bias", f"keys must be token ids as decimal strings, got {key!r}")
        if bias is None:
            raise invalid_field("logit_bias", f"the bias of token {key} is null; give a number in [-100, 100]")
        pairs.append((int(key), read_float(value, key, 0.0, lo=-100.0, hi=100.0, param="logit_bias")))
    if len({t for t, _ in pairs}) != len(pairs):
        raise invalid_field("logit_bias", "a token id appears twice (e.g. \"7\" and \"07\")")
    return tuple(pairs)


def read_token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    if not value:
        raise invalid_field(param, "the prompt is empty")
    for token_id in value:
        if not is_int(token_id) or token_id < 0:
            raise invalid_field(param, f"token ids must be non-negative integers, got {token_id!r}")
    return tuple(value)


def json_type(value: object) -> str:
    """The JSON type name of a parsed value, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
