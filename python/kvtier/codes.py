"""The named codes of kvtier: the one Python owner, shared with the C++ core.

``ItemStatus`` names the per-item outcomes of a job (``JobResult.items``):
0 ok, > 0 an errno (any may appear; the named ones are those the library
assigns or acts upon), < 0 an integrity or protocol failure.
``StatusCode`` names what a native call failed with (each maps to a class of
:mod:`kvtier.errors`). Both are :class:`enum.IntEnum` defined in
``csrc/core/codes.h`` and bound in ``csrc/bindings/codes.cc``: they compare
equal to the plain ints the core reports.

Importing this module loads the native core (``kvtier._native``); modules that
must stay cheap to import (the vLLM shim) import it where they use it.

Any process. Who calls: the tiers, the jobs layer and the integrations
reading per-item outcomes; nothing here blocks beyond the native core's
first import.
"""

from __future__ import annotations

from kvtier._native import ItemStatus, StatusCode, item_error

__all__ = ["ItemStatus", "StatusCode", "item_error"]
