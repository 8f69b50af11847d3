"""SGLang HiCache shim: kvtier's disk and Redis/Valkey tiers as the storage
("L3") backend of SGLang's hierarchical cache; the only kvtier code that
imports sglang.

SGLang loads it by module path (``--hicache-storage-backend dynamic`` with
``{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
"class_name": "KVTierStorage", "interface_v1": 1, "kvtier_disk_path": ...}``
in ``--hicache-storage-backend-extra-config``; see
:mod:`kvtier.integrations.sglang.storage`).

Importing this package loads neither SGLang nor kvtier's native core: the
backend class (and with it SGLang's storage base class) is imported when
first named, the native core when SGLang registers its host pool.

Runs in each SGLang scheduler process (one per TP/PP rank); importing it
never blocks.

Who calls: SGLang's ``StorageBackendFactory``, by module path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.integrations.sglang.config import CONFIG_KEYS, parse_extra_config, storage_namespace

if TYPE_CHECKING:
    from kvtier.integrations.sglang.storage import SUPPORTED_SGLANG, KVTierStorage

__all__ = [
    "CONFIG_KEYS",
    "SUPPORTED_SGLANG",
    "KVTierStorage",
    "parse_extra_config",
    "storage_namespace",
]


def __getattr__(name: str) -> Any:
    # SGLang's factory asks for the class by name (getattr on this module).
    if name in ("KVTierStorage", "SUPPORTED_SGLANG"):
        from kvtier.integrations.sglang import storage

        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
