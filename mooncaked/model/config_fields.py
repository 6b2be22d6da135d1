"""Typed reads of `config.json` fields, and the errors that name a bad one (model.families, model.deepseek).

1. `int_field`, `float_field`, `bool_field`, ... read one key, with a default or required; a missing or
   mistyped field raises ConfigError naming the key, so a hostile config.json gives a message, never a KeyError.
2. UnsupportedModel names an architecture or option mooncaked does not run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mooncaked.runtime.errors import StartupError


class ConfigError(StartupError, ValueError):
    """config.json has a missing, mistyped or out-of-range field; the message names it."""


class UnsupportedModel(StartupError, ValueError):
    """The checkpoint's architecture or one of its options is outside what mooncaked runs; the message names it."""


_MISSING = object()


def _get(config: Mapping[str, Any], key: str, default: Any) -> Any:
    value = config.get(key, default)
    if value is _MISSING:
        raise ConfigError(f"config.json has no {key!r}")
    return value


def int_field(config: Mapping[str, Any], key: str, default: Any = _MISSING) -> int:
    value = _get(config, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json: {key} must be an integer, got {value!r}")
    return value


def optional_int_field(config: Mapping[str, Any], key: str) -> int | None:
    return None if config.get(key) is None else int_field(config, key)


def float_field(config: Mapping[str, Any], key: str, default: Any = _MISSING) -> float:
    value = _get(config, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config.json: {key} must be a number, got {value!r}")
    return float(value)


def optional_float_field(config: Mapping[str, Any], key: str) -> float | None:
    return None if config.get(key) is None else float_field(config, key)


def bool_field(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config.json: {key} must be true or false, got {value!r}")
    return value


def token_ids_field(config: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = config.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ConfigError(f"config.json: {key} must be an integer or a list of integers, got {value!r}")
    return tuple(dict.fromkeys(values))
