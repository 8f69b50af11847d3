"""The module path configurations name for kvtier's connector
(``kv_connector_module_path``); the connector lives in
:mod:`kvtier.integrations.vllm.connector`. Imported by vLLM in its engine
core and workers only (it loads vLLM's connector modules).

Importing it blocks only for those imports.

Process: vLLM's engine core and workers. Who calls: vLLM, by module path.
"""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
