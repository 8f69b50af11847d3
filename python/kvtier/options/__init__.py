"""kvtier's options, each defined once (typed, with its default, unit and
meaning): the tiers' (:class:`HostOptions`, :class:`DiskOptions`,
:class:`RemoteOptions`) and the engines' (:class:`VllmOptions`,
:class:`SglangOptions`). vLLM's and SGLang's extra-config keys, the vLLM
secondary tiers' arguments, ``kvtier replay``'s flags and the configuration
reference are derived from them (:mod:`kvtier.options.surfaces`).

Process: any; importing it is cheap (no engine, no native core). Who calls:
the tiers, the factory, the shims, the CLI and the docs. Nothing here
blocks. ``fields`` declares an option, ``tiers`` and ``engines`` hold the
dataclasses, ``surfaces`` derives every place a user gives one.
"""

from kvtier.options.engines import EngineOptions, SglangOptions, VllmOptions
from kvtier.options.tiers import DiskOptions, HostOptions, RemoteOptions

__all__ = [
    "DiskOptions",
    "EngineOptions",
    "HostOptions",
    "RemoteOptions",
    "SglangOptions",
    "VllmOptions",
]
