"""How a ``delayq_*`` setting's value is read: a number with a floor, a flag, a TCP port or off,
seconds or off, a host to listen on. Each takes the setting's name as the user spells it
(:func:`~celery_delayq.config.setting_name`) and raises
:class:`~celery_delayq.exceptions.ConfigurationError` naming it. :class:`~celery_delayq.config.DelayQConfig`
reads every setting with these; a worker reads its flags alone with :func:`flag`.

>>> number("delayq_shards", "16", int, 1), flag("delayq_push", "off")
(16, False)
"""

from __future__ import annotations

import math
from typing import Any

from .exceptions import ConfigurationError

__all__ = [
    "address",
    "batch_expires",
    "flag",
    "number",
    "optional_seconds",
    "port",
]


def number(name: str, value: Any, kind: type, minimum: float) -> Any:
    """``value`` as ``kind`` (int or float), at least ``minimum``; strings of digits are accepted."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{name} must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError as exc:
            raise ConfigurationError(f"{name} must be a number, got {value!r}") from exc
    if not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ConfigurationError(f"{name} must be finite, got {value!r}")
    if kind is int:
        if value != int(value):
            raise ConfigurationError(f"{name} must be a whole number, got {value!r}")
        value = int(value)
    else:
        value = float(value)
    if value < minimum:
        raise ConfigurationError(f"{name} must be >= {minimum:g}, got {value!r}")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def flag(name: str, value: Any) -> bool:
    """A boolean setting: a bool, 0/1, or one of true/false/yes/no/on/off (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigurationError(f"{name} must be true or false, got {value!r}")


def port(name: str, value: Any) -> int | None:
    """A TCP port from 1 to 65535, or None (also an empty string): off.

    >>> port("p", "9808"), port("p", None), port("p", "")
    (9808, None, None)
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    found = int(number(name, value, int, -math.inf))
    if not 1 <= found <= 65535:
        raise ConfigurationError(
            f"{name} must be a TCP port from 1 to 65535 (None turns the endpoint off), got {value!r}"
        )
    return found


def optional_seconds(name: str, value: Any) -> float | None:
    """A number of seconds >= 0, or None (also an empty string): off.

    >>> optional_seconds("s", "600"), optional_seconds("s", None)
    (600.0, None)
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    seconds: float = number(name, value, float, 0)
    return seconds


def batch_expires(name: str, value: Any) -> float | None:
    """Seconds a finished batch is kept: a number >= 0.001 (one ms), or None (kept until deleted).

    >>> batch_expires("s", "86400"), batch_expires("s", None)
    (86400.0, None)
    """
    seconds = optional_seconds(name, value)
    if seconds is not None and seconds < 0.001:
        raise ConfigurationError(
            f"{name} must be a number of seconds >= 0.001, or None to keep finished batches, got {value!r}"
        )
    return seconds


def address(name: str, value: Any) -> str:
    """A host name or IP address to listen on: a non-empty string without spaces."""
    if not isinstance(value, str) or not value.strip() or " " in value.strip():
        raise ConfigurationError(f"{name} must be a host name or IP address, got {value!r}")
    return value.strip()
