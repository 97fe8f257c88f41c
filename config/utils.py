"""The config error and the two value checks every sub-config uses."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, the value and what
    is allowed (or the file at fault)."""


def check_choice(field_name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """Raise ConfigError unless `value` is one of `allowed`, listing them."""
    if value not in allowed:
        raise ConfigError(f"{field_name}={value!r} is not valid; allowed values: {list(allowed)}")


def check_positive(field_name: str, value: int | float, allow_zero: bool = False) -> None:
    """Raise ConfigError unless `value` > 0 (>= 0 with `allow_zero`)."""
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{field_name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")
