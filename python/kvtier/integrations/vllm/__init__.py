"""vLLM 0.33 connector shim: with ``vllm_connector``, the only kvtier modules
that import vllm.

Two routes, both loaded by vLLM's OffloadingConnector (or kvtier's
subclass of it, :mod:`kvtier.integrations.vllm_connector`) from
``kv_connector_extra_config``:

- the whole spec: ``{"spec_name": "KVTierOffloadingSpec",
  "spec_module_path": "kvtier.integrations.vllm", "kvtier_host_bytes": ...}``
  (kvtier's host tier, GPU worker and lower tiers); ``KVTierReportingSpec``,
  the same under KVTierConnector, which reports failed loads to vLLM;
- secondary tiers under vLLM's own ``TieringOffloadingSpec``:
  ``{"secondary_tiers": [{"type": "KVTierDiskTier", "module_path":
  "kvtier.integrations.vllm", "path": "/mnt/nvme/kv"}]}`` (and
  ``KVTierRedisTier`` with ``url``).

vLLM imports this module in its API server, engine core and every worker, so
importing it loads only vLLM's light base modules: kvtier's native core,
torch-side transfers and vLLM's heavy stats module are imported on first use.

Importing it never blocks.

Process: vLLM's API server, engine core (scheduler) and workers. Who
calls: vLLM's OffloadingConnector, by module path.
"""

from kvtier.integrations.vllm.config import (
    CONFIG_KEYS,
    KVTIER_METRICS,
    check_engine,
    engine_namespace,
    parse_extra_config,
)
from kvtier.integrations.vllm.host_spec import KVTierSpec
from kvtier.integrations.vllm.scheduler import KVTierManager, following_keys
from kvtier.integrations.vllm.secondary import KVTierDiskTier, KVTierRedisTier
from kvtier.integrations.vllm.spec import KVTierOffloadingSpec, KVTierReportingSpec
from kvtier.integrations.vllm.worker import KVTierWorker

__all__ = [
    "CONFIG_KEYS",
    "KVTIER_METRICS",
    "KVTierDiskTier",
    "KVTierManager",
    "KVTierOffloadingSpec",
    "KVTierRedisTier",
    "KVTierReportingSpec",
    "KVTierSpec",
    "KVTierWorker",
    "check_engine",
    "engine_namespace",
    "following_keys",
    "parse_extra_config",
]
