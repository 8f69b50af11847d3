"""NullConnector: a vLLM KV connector that moves nothing, the floor of what
any KV connector costs an engine.

With a connector configured, vLLM runs per step what it runs for every
connector: the connector's scheduler and worker calls, a hook around every
attention layer, the connector's output shipped from the worker to the
engine core. ``kvtier bench serve --server`` runs this connector as the
``connector-floor`` configuration, so kvtier's cost on a workload with no
reuse is read against what no connector can avoid, not only against an
engine without one.

Process: vLLM's engine core (scheduler side) and its workers (worker side),
loaded by module path (``kv_connector_module_path``). Who calls: vLLM. Never
blocks; never loads or stores.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

__all__ = ["NullConnector"]


class NullConnector(KVConnectorBase_V1):
    """Every hook of vLLM's connector interface, each doing nothing: no
    external hit, no load, no store."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return KVConnectorMetadata()
