"""The public path of :class:`StreamLoader` (``kvtier.streaming``): it lives
in :mod:`kvtier.worker.streaming`.

Process: the engine's worker. Who calls: users and tests import through this
path; importing blocks on nothing.
"""

from kvtier.worker.streaming import StreamChunk, StreamLoader

__all__ = ["StreamChunk", "StreamLoader"]
