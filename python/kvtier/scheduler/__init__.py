"""The scheduler side of kvtier: the offloading-manager facade and its rooms.

Runs in the engine's scheduler process, on its scheduling thread, under the
manager's lock. :class:`~kvtier.scheduler.manager.TieredOffloadingManager` is
the facade (vLLM 0.33's ``OffloadingManager`` interface); the rooms behind it:

- :mod:`.slots`: tier jobs in flight and who owns a host slot (O(1));
- :mod:`.movement`: write-through cascade and promotion between tiers;
- :mod:`.readahead`: a request's lower-tier reads waited for in its scan;
- :mod:`.fences`: fenced fills (HIT before the bytes arrive);
- :mod:`.streams`: blocks the engine's worker reads or writes itself;
- :mod:`.options`, :mod:`.stats`, :mod:`.specs`: configuration, counters,
  and what crosses to the worker.

Who calls: the vLLM shim, replay, benchmarks. Only the read-ahead blocks
(bounded per step). Importing this package loads neither the native core
nor vLLM.
"""
