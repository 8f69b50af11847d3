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

#: How long a worker waits for one of its transfers before it calls the job
#: lost (:class:`kvtier.Timeout`): far above the longest legitimate wait (a
#: fenced load waits at most 30 s for its lower-tier read, then fails; a
#: queue holds at most its byte budget, 1 GiB by default, behind at most one
#: forward pass), so that only a copy that will never end reaches it. The
#: vLLM shim's ``kvtier_transfer_wait_s`` (:class:`kvtier.options.VllmOptions`).
WAIT_TIMEOUT_S = 120.0
