"""The node cache: one kvtier per machine that every engine on it shares.

:mod:`.server` (the ``kvtier node`` process) owns the host pool, index,
policy and lower tiers and serves engines over a Unix socket
(:mod:`.protocol`); :mod:`.state` keeps its slot classes and the engines'
leases; :mod:`.client` is the engine's side. Importing this package loads
nothing heavy. Who calls: ``kvtier node`` (the server), the vLLM shim
(the client); importing it never blocks.
"""
