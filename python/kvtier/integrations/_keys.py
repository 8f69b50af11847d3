"""One check of kvtier's keys in an engine's free-form extra config (vLLM's
``kv_connector_extra_config``, SGLang's ``--hicache-storage-backend-extra-config``).

Runs in whichever engine process parses the config (vLLM's API server,
engine core and workers; SGLang's scheduler processes); pure, never blocks,
imports no engine and not the native core. Callers: the vLLM and SGLang
``config`` modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.errors import InvalidArgument

# name -> (accepted type or types, what the key is)
KeySchema = Mapping[str, tuple[type | tuple[type, ...], str]]


def kvtier_keys(
    extra: Mapping[Any, Any], schema: KeySchema, where: str, *, skip_non_str: bool = False
) -> dict[str, Any]:
    """The ``kvtier_`` keys of ``extra`` with their values, each checked
    against ``schema``: an unknown ``kvtier_`` key or a value of another type
    (a bool is never an int here) raises InvalidArgument naming ``where``;
    other keys are the engine's and pass. A key that is not a string is
    refused, or passed over with ``skip_non_str``."""
    got: dict[str, Any] = {}
    for key, value in extra.items():
        if not isinstance(key, str):
            if skip_non_str:
                continue
            raise InvalidArgument(f"{where} keys must be strings, got {key!r}")
        if not key.startswith("kvtier_"):
            continue
        if key not in schema:
            known = ", ".join(sorted(schema))
            raise InvalidArgument(f"unknown {where} key {key!r}; known: {known}")
        typ, _ = schema[key]
        if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
            raise InvalidArgument(f"{key}: expected {typ}, got {value!r}")
        got[key] = value
    return got
