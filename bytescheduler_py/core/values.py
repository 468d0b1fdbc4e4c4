"""The parsers every option goes through: sizes, booleans, durations, log levels.

Each takes the value and the option's name (for the error) and returns it checked, or raises
``ValueError`` naming the forms it accepts.

>>> parse_size("512KiB", "partition_bytes")
524288
>>> format_size(4 * 1024**2)
'4MiB'
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Optional, Union

Size = Union[int, str]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_FORMS = "a positive integer number of bytes or a size such as '4MB', '4MiB', '512KiB', '1GB'"

def parse_size(value: Size, name: str) -> int:
    """Return ``value`` as a positive number of bytes; ``name`` is used in the error."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size: use {SIZE_FORMS}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a size: use {SIZE_FORMS}")
        number = math.floor(Decimal(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"{name}={value!r} is not a size: use {SIZE_FORMS}")
    if number <= 0:
        raise ValueError(f"{name}={value!r} must be positive: use {SIZE_FORMS}")
    return number


def format_size(nbytes: int) -> str:
    """``nbytes`` as :func:`parse_size` reads it back, in the largest binary unit that divides it.

    >>> format_size(4 * 1024**2), format_size(1536), format_size(1000)
    ('4MiB', '1536B', '1000B')
    >>> format_size(256 * 1024)
    '256KiB'
    """
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


def parse_nonnegative_size(value: Size, name: str) -> int:
    """Like :func:`parse_size` but also accepts 0 (meaning: off)."""
    if value == 0 or (isinstance(value, str) and value.strip() == "0"):
        return 0
    try:
        return parse_size(value, name)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a size: use 0 (off), {SIZE_FORMS}") from None


def parse_bool(value: Union[bool, int, str], name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def _number(value: Union[float, int, str]) -> float:
    """``value`` as a float; NaN (which every range check rejects) when it is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


# Longer timeouts count as this (31 years): the threads' waits cannot take much more.
MAX_TIMEOUT = 1e9


def parse_timeout(value: Union[float, int, str], name: str) -> float:
    """A positive number of seconds; above :data:`MAX_TIMEOUT` (in effect: never), that."""
    seconds = _number(value)
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"{name}={value!r} is not a timeout: use a positive number of seconds")
    return min(seconds, MAX_TIMEOUT)


def parse_milliseconds(value: Union[float, int, str], name: str) -> float:
    """A non-negative, finite number of milliseconds (0 means off)."""
    milliseconds = _number(value)
    if not milliseconds >= 0 or math.isinf(milliseconds):
        raise ValueError(f"{name}={value!r} is not a duration: use a non-negative number of milliseconds (0: off)")
    return milliseconds


_LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "critical": 50}


def parse_log_level(value: Union[int, str], name: str) -> Optional[int]:
    """``"0"``/``""`` means off; ``"1"``/``"true"`` means DEBUG; level names and numbers work."""
    text = str(value).strip().lower()
    if text in ("", "0", "false", "off", "no"):
        return None
    if text in ("1", "true", "on", "yes"):
        return 10
    if text in _LEVELS:
        return _LEVELS[text]
    if text.isdigit():
        return int(text)
    raise ValueError(
        f"{name}={value!r} is not a log level: use 1 (debug), 0 (off), or one of "
        "DEBUG, INFO, WARNING, ERROR, CRITICAL"
    )
