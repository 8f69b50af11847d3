"""Every surface a user configures kvtier through, derived from the option
dataclasses: an engine's extra config (vLLM, SGLang), the arguments of
kvtier's vLLM secondary tiers, ``kvtier replay``'s flags, and the
configuration reference page.

Process: any; pure and cheap except :func:`reference_markdown` (which only
formats text). Who calls: the vLLM and SGLang shims (once per process, at
start-up), the CLI, the docs generator and the tests that keep the surfaces
in step. Nothing blocks; bad input raises
:class:`~kvtier.errors.InvalidArgument` naming the key or flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.errors import InvalidArgument
from kvtier.options.engines import EngineOptions, SglangOptions, VllmOptions
from kvtier.options.fields import KINDS, Option, convert, options_of
from kvtier.options.tiers import DiskOptions, HostOptions, RemoteOptions
from kvtier.units import parse_capacity

__all__ = [
    "EngineConfig",
    "add_tier_arguments",
    "add_tls_arguments",
    "engine_keys",
    "engine_options",
    "parse_disk_spec",
    "parse_engine_config",
    "reference_markdown",
    "secondary_options",
    "tier_options_from_args",
    "tls_settings",
]

T = TypeVar("T")
_TIERS: tuple[type, ...] = (HostOptions, DiskOptions, RemoteOptions)
_ENGINES: dict[str, type[EngineOptions]] = {"vllm": VllmOptions, "sglang": SglangOptions}


@dataclass(frozen=True)
class EngineConfig:
    """kvtier's part of an engine's extra config, parsed: the host tier, the
    lower tiers (None: not configured: no path, no URL), the engine's own
    options, and the keys given (so a shim can tell a default from a choice)."""

    host: HostOptions
    disk: DiskOptions | None
    remote: RemoteOptions | None
    engine: Any  # VllmOptions or SglangOptions, by the engine parsed for
    given: frozenset[str]


def engine_options(engine: str) -> list[Option]:
    """The options an engine's extra config takes (``"vllm"`` or ``"sglang"``),
    tiers first, in declaration order."""
    return [
        o for cls in (*_TIERS, _ENGINES[engine]) for o in options_of(cls) if engine in o.surfaces
    ]


def engine_keys(engine: str) -> dict[str, tuple[tuple[type, ...], str]]:
    """key -> (accepted JSON/YAML value types, meaning) of an engine's extra config."""
    return {str(o.key): (KINDS[o.kind][0], o.doc) for o in engine_options(engine)}


def parse_engine_config(extra: Any, engine: str, where: str) -> EngineConfig:
    """Validate and convert the ``kvtier_`` keys of an engine's extra config
    (``where`` names it in errors): an unknown ``kvtier_`` key, a value of
    another type (a bool is never an int here) or out of range raises
    :class:`~kvtier.errors.InvalidArgument`; the engine's own keys pass (and
    SGLang's non-string keys). Pure."""
    if not isinstance(extra, Mapping):
        raise InvalidArgument(f"{where} must be a mapping, got {type(extra).__name__}")
    by_key = {str(o.key): o for o in engine_options(engine)}
    values: dict[str, dict[str, Any]] = {}
    for key, value in extra.items():
        if not isinstance(key, str):
            if engine == "sglang":
                continue
            raise InvalidArgument(f"{where} keys must be strings, got {key!r}")
        if not key.startswith("kvtier_"):
            continue
        o = by_key.get(key)
        if o is None:
            raise InvalidArgument(
                f"unknown {where} key {key!r}; known: {', '.join(sorted(by_key))}"
            )
        values.setdefault(o.owner, {})[o.name] = convert(o, value, key)
    eng_cls = _ENGINES[engine]
    eng = _build(eng_cls, values.get(eng_cls.__name__, {}), where)
    lower = getattr(eng, "lower_admit_after", 1)
    disk = values.get("DiskOptions", {})
    remote = values.get("RemoteOptions", {})
    for given in (disk, remote):
        given.setdefault("admit_after", lower)
    return EngineConfig(
        _build(HostOptions, values.get("HostOptions", {}), where),
        # Checked even where not configured: a bad setting is an error either way.
        _configured(_build(DiskOptions, disk, where), "path" in disk),
        _configured(_build(RemoteOptions, remote, where), "url" in remote),
        eng,
        frozenset(k for k in extra if isinstance(k, str) and k in by_key),
    )


def secondary_options(cls: type[T], kwargs: Mapping[str, Any], where: str) -> T:
    """``cls`` (:class:`DiskOptions` or :class:`RemoteOptions`) from the
    keyword arguments vLLM passes a secondary tier (its ``secondary_tiers``
    entry): field names, values as in an engine's config. Pure."""
    known = {o.name: o for o in options_of(cls) if "secondary" in o.surfaces}
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    values = {k: convert(known[k], v, k) for k, v in kwargs.items()}
    return _build(cls, values, where, {k: k for k in values})


def _configured(options: T, given: bool) -> T | None:
    return options if given else None


def _build(
    cls: type[T], values: dict[str, Any], where: str, spelled_as: Mapping[str, str] | None = None
) -> T:
    """``cls(**values)``; a check that fails names the option as the user
    spelled it: ``spelled_as[field]`` (a flag, an argument), else its engine
    key, else the field."""
    try:
        return cls(**values)
    except InvalidArgument as e:
        msg = str(e)
        for o in options_of(cls):
            if msg.startswith(f"{o.name} ") or msg.startswith(f"{o.name}:"):
                spelled = (spelled_as or {}).get(o.name) or o.key or o.name
                if spelled:
                    rest = msg[len(o.name) :].lstrip(": ")
                    raise InvalidArgument(f"{where}: {spelled}: {rest}") from None
        raise InvalidArgument(f"{where}: {msg}") from None


# -- kvtier replay's flags ------------------------------------------------------

_DISK_SPEC = "--disk"  # DIR:SIZE, the disk tier's path and capacity in one flag


_METAVARS = {
    "str": "TEXT",
    "int": "N",
    "seconds": "SECONDS",
    "milliseconds": "MS",
    "bytes": "SIZE",
    "capacity": "SIZE",
    "rate": "BYTES_PER_S",
    "entries": "N",
}


def _cli_options() -> list[Option]:
    return [o for cls in _TIERS for o in options_of(cls) if "cli" in o.surfaces]


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the tiers' flags (every option whose surfaces include ``cli``) to
    ``parser``; a flag several options declare (``--lower-admit-after``) is
    one argument that sets them all, each option's own flag winning. Every
    default is None (not given): the dataclass's own default applies
    (:func:`tier_options_from_args`)."""
    opts = _cli_options()
    count = Counter(f for o in opts for f in o.flags)
    for flag in sorted(f for f, n in count.items() if n > 1 and f != _DISK_SPEC):
        o = next(o for o in opts if flag in o.flags)
        owners = " and ".join(
            sorted({p.owner.removesuffix("Options").lower() for p in opts if flag in p.flags})
        )
        parser.add_argument(
            flag,
            dest=_dest(flag),
            metavar=_METAVARS.get(o.kind, "VALUE"),
            help=f"{owners} tiers: {o.doc}",
        )
    parser.add_argument(
        _DISK_SPEC,
        metavar="DIR:SIZE",
        dest=_dest(_DISK_SPEC),
        help="disk tier: its directory and size, e.g. /mnt/nvme/kv:100GiB, or DIR:80%% "
        "of the free space",
    )
    for o in opts:
        flags = [f for f in o.flags if count[f] == 1]
        if not flags:
            continue
        kw: dict[str, Any] = {"default": None, "dest": _dest(flags[0])}
        if o.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif o.choices:
            kw["metavar"] = "{" + ",".join(o.choices) + "}"
        else:
            kw["metavar"] = "URL" if o.name == "url" else _METAVARS.get(o.kind, "VALUE")
        help_ = o.doc + (f" ({o.unit})" if o.unit else "")
        default = "" if o.default is None else f"; default {_shown(o.default)}"
        parser.add_argument(*flags, help=(help_ + default).replace("%", "%%"), **kw)


def tier_options_from_args(
    args: argparse.Namespace, **fixed: Any
) -> tuple[HostOptions, DiskOptions | None, RemoteOptions | None]:
    """The tiers' options from flags :func:`add_tier_arguments` added: the host
    tier's, the disk tier's (None without ``--disk``), the remote tier's (None
    without ``--remote``). ``fixed``: ``"<Class>.<field>"`` -> value set by
    the caller (``DiskOptions.no_data`` from replay's ``--no-data``)."""
    values: dict[str, dict[str, Any]] = {cls.__name__: {} for cls in _TIERS}
    used: dict[str, str] = {}  # field -> the flag that gave it, for errors
    for o in _cli_options():
        if o.flags[0] == _DISK_SPEC:
            continue
        flag = next((f for f in o.flags if getattr(args, _dest(f), None) is not None), None)
        if flag is not None:
            values[o.owner][o.name] = convert(o, getattr(args, _dest(flag)), flag, text=True)
            used[o.name] = flag
    spec = getattr(args, _dest(_DISK_SPEC), None)
    if spec:
        path, size = parse_disk_spec(spec)
        values["DiskOptions"].update(path=path, capacity_bytes=size)
    for name, value in fixed.items():
        owner, _, field = name.partition(".")
        values[owner][field] = value
    disk, remote = values["DiskOptions"], values["RemoteOptions"]
    return (
        _build(HostOptions, values["HostOptions"], "kvtier replay", used),
        _configured(_build(DiskOptions, disk, "kvtier replay", used), "path" in disk),
        _configured(_build(RemoteOptions, remote, "kvtier replay", used), "url" in remote),
    )


def parse_disk_spec(spec: str) -> tuple[str, Any]:
    """``DIR:SIZE`` as ``--disk`` takes it (``/mnt/nvme/kv:100GiB``, ``DIR:80%`` of
    the free space) -> (directory, capacity). Raises InvalidArgument."""
    path, sep, size = spec.rpartition(":")
    if not sep or not path:
        raise InvalidArgument(
            f"--disk wants DIR:SIZE (e.g. /mnt/nvme/kv:100GiB or DIR:80%), got {spec!r}"
        )
    try:
        return path, parse_capacity(size)
    except InvalidArgument as e:
        raise InvalidArgument(f"--disk {spec!r}: {e}") from None


def add_tls_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The remote tier's TLS settings as flags of a tool that opens its own
    client (``kvtier events``, ``kvtier bench remote``): ``--tls-ca-file``
    (``--tls-ca``), ``--tls-cert-file``, ``--tls-key-file``, ``--tls-server-name``,
    each stored under its option's name (:func:`tls_settings`)."""
    for o in _tls_options():
        flags = [f.replace("--remote-", "--", 1) for f in o.flags]
        parser.add_argument(*flags, dest=o.name, help=o.doc)


def tls_settings(args: argparse.Namespace) -> dict[str, str | None]:
    """The TLS settings :func:`add_tls_arguments` parsed: option name -> value."""
    return {o.name: getattr(args, o.name) for o in _tls_options()}


def _tls_options() -> list[Option]:
    return [o for o in options_of(RemoteOptions) if o.name.startswith("tls_")]


def _dest(flag: str) -> str:
    return "opt_" + flag.lstrip("-").replace("-", "_")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 30}GiB" if value % (1 << 30) == 0 else f"{value >> 20}MiB"
    return str(value)


# -- the configuration reference --------------------------------------------------

_SURFACE_NAMES = {
    "vllm": "vLLM key",
    "sglang": "SGLang key",
    "secondary": "secondary tier",
    "cli": "kvtier replay",
}


def reference_markdown(
    classes: Sequence[type] = (*_TIERS, EngineOptions, VllmOptions, SglangOptions),
) -> str:
    """The configuration reference page (``docs/reference/configuration.md``):
    per option class, each option with its default, unit, meaning and its
    spelling on every surface. Pure; the docs test compares it with the page."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by docs/gen_config.py from kvtier.options: do not edit. -->",
        "",
        "Every option is defined once, in `kvtier.options`; the keys of vLLM's "
        "`kv_connector_extra_config`, of SGLang's `--hicache-storage-backend-extra-config`, "
        "the arguments of the vLLM secondary tiers and the flags of `kvtier replay` below are "
        "derived from those definitions. Sizes take text (`64GiB`) or bytes; a disk capacity "
        "also takes a share of the free space (`80%`).",
        "",
    ]
    for cls in classes:
        own = {
            f.name
            for f in dataclasses.fields(cls)
            if f.name in vars(cls).get("__annotations__", {})
        }
        opts = [o for o in options_of(cls) if o.name in own]
        out += [
            f"## {cls.__name__}",
            "",
            (cls.__doc__ or "").strip().splitlines()[0],
            "",
            "| option | default | meaning | where |",
            "| --- | --- | --- | --- |",
        ]
        for o in opts:
            where = []
            for s in ("vllm", "sglang", "secondary", "cli"):
                if s in o.surfaces:
                    spelled = {
                        "vllm": o.key,
                        "sglang": o.key,
                        "secondary": o.name,
                        "cli": " ".join(o.flags),
                    }[s]
                    where.append(f"{_SURFACE_NAMES[s]}: `{spelled}`")
            if not o.surfaces:
                where.append("Python only")
            unit = f" ({o.unit})" if o.unit else ""
            choices = f" One of: {', '.join(o.choices)}." if o.choices else ""
            default = "none" if o.default is None else _shown(o.default)
            cell = "<br>".join(where)
            out.append(f"| `{o.name}` | `{default}` | {o.doc}{unit}.{choices} | {cell} |")
        out.append("")
    return "\n".join(out)
