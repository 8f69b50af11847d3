"""The engine-worker side of kvtier: what runs in each worker process (one
per GPU) and touches the engine's KV cache.

- :mod:`.transfer`: :class:`~kvtier.worker.transfer.DeviceTransfer`, copies
  between the KV cache and host-pool slots (CPU memcpy or CUDA, on kvtier's
  threads);
- :mod:`.streaming`: :class:`~kvtier.worker.streaming.StreamLoader`, loads
  and stores whose blocks the worker reads from or writes to a lower tier
  itself, through a staging ring (the readers come from the tiers' typed
  reader specs: :class:`kvtier.tiers.base.ReaderSpec`).

Process: the engine's worker. Who calls: the vLLM shim's worker
(:mod:`kvtier.integrations.vllm.worker`), one thread. Submissions never
block; ``wait`` and ``close`` do. Importing this package loads nothing heavy.
"""
