"""Names a package exports but imports only on first use.

Who calls: ``kvtier/__init__.py`` and ``kvtier/tiers/__init__.py``, so that
importing them (as every vLLM process does through the shim) loads neither
the native core nor numpy-heavy modules. Never blocks beyond the import.

Any process.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``names[name]`` (a module path)
    on first access and returns its attribute ``name``."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
