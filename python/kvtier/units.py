"""Sizes and durations as people write them (``256KiB``, ``30s``).

Who calls: every configuration surface (the CLI, ``replay``, the planner, the
vLLM shim's ``kv_connector_extra_config``, the tier factory). Pure functions:
nothing blocks, nothing is imported beyond the error types.

Any process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.errors import InvalidArgument

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}

_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}


def _split(text: str) -> tuple[str, str]:
    """``"2.5GiB"`` -> ``("2.5", "gib")``: the number and its lower-case unit."""
    s = text.strip().lower()
    i = len(s)
    while i > 0 and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    return s[:i], s[i:].strip()


def _quantity(text: str, units: Mapping[str, float], what: str, examples: str) -> float:
    """A number with a unit of ``units`` (the empty unit included) -> the
    number times the unit; finite or InvalidArgument."""
    num, unit = _split(text)
    if not num or unit not in units:
        raise InvalidArgument(f"cannot parse {what} {text!r} (examples: {examples})")
    try:
        value = float(num) * units[unit]
    except ValueError:
        raise InvalidArgument(f"cannot parse {what} {text!r}") from None
    if not math.isfinite(value):  # "1e999": int() of it would raise OverflowError
        raise InvalidArgument(f"{what} {text!r} is out of range")
    return value


def parse_size(text: str) -> int:
    """``"256KiB"``, ``"2MiB"``, ``"1GB"``, ``"65536"`` -> bytes (> 0). Raises InvalidArgument."""
    n = int(_quantity(text, _SIZE_UNITS, "size", "65536, 256KiB, 2MiB, 1GiB"))
    if n <= 0:
        raise InvalidArgument(f"size must be > 0, got {text!r}")
    return n


def format_size(n: int) -> str:
    """``16777216`` -> ``"16.0 MiB"``: a size for a message (binary units)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def to_bytes(key: str, value: object) -> int:
    """A size given either as an int of bytes or as text (``"64GiB"``), > 0.

    ``key`` names the setting in the error (configuration dictionaries, where
    a YAML or JSON value may arrive as either type). Raises InvalidArgument.
    """
    if isinstance(value, bool):
        raise InvalidArgument(f"{key}: expected a size, got {value!r}")
    n = value if isinstance(value, int) else parse_size(str(value))
    if n <= 0:
        raise InvalidArgument(f"{key}: must be > 0, got {value!r}")
    return n


@dataclass(frozen=True)
class FreeFraction:
    """A capacity given as a share of a file system's free space (``"80%"``).

    It stays a fraction until the tier that uses it knows its directory
    (:func:`kvtier.tiers.disk.resolve_capacity`), so one setting means the
    same thing wherever it is given.
    """

    fraction: float  # in (0, 1]

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%"


def parse_capacity(text: str) -> int | FreeFraction:
    """A disk capacity: a size (``"100GiB"``, bytes > 0) or a share of the
    free space (``"80%"``, in (0, 100]). Raises InvalidArgument."""
    s = text.strip()
    if not s.endswith("%"):
        return parse_size(s)
    try:
        pct = float(s[:-1])
    except ValueError:
        raise InvalidArgument(f"cannot parse capacity {text!r} (examples: 100GiB, 80%)") from None
    if not 0 < pct <= 100:  # also rejects nan
        raise InvalidArgument(
            f"a capacity in percent of free space must be in (0, 100], got {text!r}"
        )
    return FreeFraction(pct / 100)


def to_capacity(key: str, value: object) -> int | FreeFraction:
    """:func:`to_bytes` that also takes a share of free space (``"80%"``)."""
    if isinstance(value, FreeFraction):
        return value
    if isinstance(value, str):
        try:
            return parse_capacity(value)
        except InvalidArgument as e:
            raise InvalidArgument(f"{key}: {e}") from None
    return to_bytes(key, value)


def parse_duration(text: str) -> float:
    """``"30"``, ``"30s"``, ``"250ms"``, ``"2min"`` -> seconds (> 0). Raises InvalidArgument."""
    value = _quantity(text, _SECONDS, "duration", "30, 30s, 250ms, 2min")
    if not value > 0:
        raise InvalidArgument(f"duration must be finite and > 0, got {text!r}")
    return value
