"""How an option is declared: one dataclass field carrying its kind, unit,
meaning and the spelling of each surface that exposes it.

Process: any (the vLLM shim's API server, the scheduler, the CLI, the docs
build); pure, never blocks, imports neither an engine nor the native core.
Who calls: the option dataclasses (:mod:`kvtier.options.tiers`,
:mod:`kvtier.options.engines`) declare fields with :func:`opt`;
:mod:`kvtier.options.surfaces` reads them back with :func:`options_of`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.units import FreeFraction, to_bytes, to_capacity

__all__ = ["KINDS", "SURFACES", "Option", "convert", "key_of", "opt", "options_of"]

SURFACES = ("vllm", "sglang", "secondary", "cli")
"""Where a user gives an option: vLLM's ``kv_connector_extra_config``,
SGLang's ``--hicache-storage-backend-extra-config``, the keyword arguments of
kvtier's vLLM secondary tiers (``secondary_tiers`` entries), ``kvtier replay``'s
flags."""

# kind -> (value types an engine's JSON/YAML config may give, unit shown in the reference)
KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "str": ((str,), ""),
    "int": ((int,), ""),
    "bool": ((bool,), ""),
    "seconds": ((int, float), "seconds"),
    "milliseconds": ((int, float), "milliseconds"),
    "bytes": ((int, str), "bytes (or text: 64GiB)"),
    "capacity": ((int, str), "bytes (or text: 100GiB, or 80% of the free space)"),
    "rate": ((int, float, str), "bytes per second (or text: 2GiB)"),
    # A bool turns it on (the default bound) or off, an int bounds it (0: off).
    "entries": ((bool, int), "entries (true: the default, false or 0: off)"),
}


@dataclass(frozen=True)
class Option:
    """One option as declared (:func:`opt`) and resolved against its class.

    ``key``: its name in an engine's extra config (None: no engine key);
    ``flags``: ``kvtier replay``'s flags, the first one canonical;
    ``surfaces``: where it is given; ``absent``: why it is not given on the
    other surfaces (required when it is missing from one)."""

    name: str
    owner: str
    kind: str
    doc: str
    default: Any
    key: str | None
    flags: tuple[str, ...]
    surfaces: frozenset[str]
    absent: str
    choices: tuple[str, ...]

    @property
    def unit(self) -> str:
        return KINDS[self.kind][1]


def opt(
    default: Any,
    doc: str,
    *,
    kind: str = "str",
    key: str | None = None,
    flags: Sequence[str] = (),
    surfaces: Sequence[str] = SURFACES,
    absent: str = "",
    choices: Sequence[str] = (),
) -> Any:
    """A dataclass field declaring an option (its meaning in ``doc``, its
    ``kind`` from :data:`KINDS`). ``key`` and ``flags`` override the
    spellings derived from the class's ``PREFIX`` (``kvtier_<prefix>_<name>``,
    ``--<prefix>-<name>``). Called at class definition; pure."""
    if kind not in KINDS:
        raise ValueError(f"unknown option kind {kind!r}")
    unknown = set(surfaces) - set(SURFACES)
    if unknown:
        raise ValueError(f"unknown surfaces {sorted(unknown)}")
    meta = {
        "kind": kind,
        "doc": doc,
        "key": key,
        "flags": tuple(flags),
        "surfaces": frozenset(surfaces),
        "absent": absent,
        "choices": tuple(choices),
    }
    return dataclasses.field(default=default, metadata={"kvtier": meta})


def options_of(cls: type) -> list[Option]:
    """The options of dataclass ``cls`` in field order, with their surface
    spellings resolved (fields declared without :func:`opt` are left out)."""
    prefix = getattr(cls, "PREFIX", "")
    out = []
    for f in dataclasses.fields(cls):
        m = f.metadata.get("kvtier")
        if m is None:
            continue
        stem = f"{prefix}_{f.name}" if prefix else f.name
        key = m["key"] or f"kvtier_{stem}"
        flags = m["flags"] or ("--" + stem.replace("_", "-"),)
        on_engine = bool(m["surfaces"] & {"vllm", "sglang"})
        out.append(
            Option(
                f.name,
                cls.__name__,
                m["kind"],
                m["doc"],
                f.default,
                key if on_engine else None,
                flags if "cli" in m["surfaces"] else (),
                m["surfaces"],
                m["absent"],
                m["choices"],
            )
        )
    return out


def key_of(cls: type, name: str) -> str:
    """The engine key of ``cls``'s option ``name`` (for a message or a shim
    that sets one). Raises KeyError for an option no engine takes."""
    o = next(o for o in options_of(cls) if o.name == name)
    if o.key is None:
        raise KeyError(f"{cls.__name__}.{name} has no engine key")
    return o.key


def convert(o: Option, value: Any, where: str, *, text: bool = False) -> Any:
    """``value`` as given for option ``o`` (an engine's JSON/YAML value, or
    the text of a flag, ``text``) in the type its field holds; ``where`` names the
    setting in errors. Raises InvalidArgument. Pure."""
    if value is None and o.default is None:
        return None
    types = KINDS[o.kind][0]
    if text and isinstance(value, str) and str not in types:  # a flag's text
        value = _from_text(o, value, where)
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise InvalidArgument(f"{where}: expected {_type_names(types)}, got {value!r}")
    try:
        return _convert(o, value, where)
    except InvalidArgument as e:
        if str(e).startswith(f"{where}:"):
            raise
        raise InvalidArgument(f"{where}: {e}") from None


def _convert(o: Option, value: Any, where: str) -> Any:
    if o.kind in ("bytes", "rate"):
        if value == 0 and not o.default:  # "0: none" where the default is none
            return 0
        value = to_bytes(where, value) if not isinstance(value, float) else value
        return float(value) if o.kind == "rate" else value
    if o.kind == "capacity":
        return to_capacity(where, value)
    if o.kind in ("seconds", "milliseconds"):
        return float(value)
    if o.kind == "entries" and isinstance(value, bool):
        return o.default if value else 0
    if o.choices and value not in o.choices:
        raise InvalidArgument(f"{where}: must be one of {', '.join(o.choices)}, got {value!r}")
    return value


def _from_text(o: Option, text: str, where: str) -> Any:
    try:
        if o.kind in ("int", "entries"):
            return int(text)
        if o.kind in ("seconds", "milliseconds"):
            return float(text)
    except ValueError:
        raise InvalidArgument(f"{where}: expected a number, got {text!r}") from None
    if o.kind == "bool":
        low = text.lower()
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise InvalidArgument(f"{where}: expected true or false, got {text!r}")
        return low in ("true", "1", "yes")
    return text


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def check_positive(**values: float | FreeFraction | None) -> None:
    """Raises InvalidArgument naming the first of ``values`` that is given
    and not > 0 (None: not given). Called by the dataclasses' checks."""
    for name, v in values.items():
        if v is not None and not isinstance(v, FreeFraction) and not v > 0:
            raise InvalidArgument(f"{name} must be > 0, got {v}")
