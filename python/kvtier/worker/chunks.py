"""How an engine's KV blocks map onto kvtier's chunks: the arithmetic of one
transfer, split per KV-cache group, per chunk and per layer.

An engine hands a job as one list of its blocks (every group's, back to
back, with each group's count and the index of its first block in the
request) and one host slot (or stream row, -1) per chunk of
``blocks_per_chunk`` blocks; a group whose first block is not the first of
a chunk (a sliding window, a partial prefix) starts inside its first chunk.

Process: the engine's worker. Who calls: the vLLM shim's worker
(:class:`kvtier.integrations.vllm.worker.KVTierWorker`); pure arithmetic over
numpy arrays, nothing blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["GroupPart", "chunk_bounds", "layer_ranges", "runs", "split_groups"]


class GroupPart(NamedTuple):
    """One KV-cache group's part of a job: its blocks, its chunks' slots and
    the index of its first block in the request."""

    group: int
    blocks: np.ndarray
    slots: np.ndarray
    first: int


def split_groups(
    blocks: np.ndarray,
    slots: np.ndarray,
    blocks_per_chunk: int,
    group_sizes: Sequence[int] | None = None,
    block_indices: Sequence[int] | None = None,
) -> list[GroupPart]:
    """``blocks`` and ``slots`` (one per chunk) cut per group, in group order.
    ``group_sizes``: blocks per group (None: one group of all); ``block_indices``:
    each group's first block index in the request (None: 0). A group of n
    blocks starting at index f spans ceil((f mod bpc + n) / bpc) chunks."""
    sizes = list(group_sizes or [len(blocks)])
    firsts = list(block_indices or [0] * len(sizes))
    out, b0, s0 = [], 0, 0
    for g, (n, first) in enumerate(zip(sizes, firsts)):
        chunks = -(-((first % blocks_per_chunk) + n) // blocks_per_chunk) if n else 0
        out.append(GroupPart(g, blocks[b0 : b0 + n], slots[s0 : s0 + chunks], int(first)))
        b0, s0 = b0 + n, s0 + chunks
    return out


def chunk_bounds(
    first: int, num_blocks: int, num_chunks: int, blocks_per_chunk: int
) -> list[tuple[int, int]]:
    """Per chunk of a group part, the ``[lo, hi)`` range of its blocks (a
    part starting at ``first`` fills its first chunk from ``first mod bpc``)."""
    skip = first % blocks_per_chunk
    return [
        (max(0, c * blocks_per_chunk - skip), min(num_blocks, (c + 1) * blocks_per_chunk - skip))
        for c in range(num_chunks)
    ]


def runs(slots: np.ndarray) -> Iterator[tuple[bool, int, int]]:
    """``(in_host, start, end)`` of each maximal run of chunks: in host slots
    (slot >= 0, moved as one transfer job) or streamed (-1, one chunk each)."""
    c, n = 0, len(slots)
    while c < n:
        if slots[c] < 0:
            yield False, c, c + 1
            c += 1
            continue
        end = c
        while end < n and slots[end] >= 0:
            end += 1
        yield True, c, end
        c = end


def layer_ranges(num_tensors: int, per_layer: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` tensor ranges of each layer, in layer order, for a
    group holding ``per_layer`` tensors a layer (a load waited for layer by
    layer is one transfer job per range, so layer 0 is ready first)."""
    return [(i * per_layer, (i + 1) * per_layer) for i in range(num_tensors // per_layer)]
