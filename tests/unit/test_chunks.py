"""The engine-block to chunk arithmetic of one transfer (kvtier.worker.chunks):
per group, per chunk and per layer, with exact expectations."""

from __future__ import annotations

import numpy as np
from kvtier.worker.chunks import chunk_bounds, layer_ranges, runs, split_groups


def test_one_group_of_whole_chunks() -> None:
    blocks, slots = np.arange(8), np.array([5, 6])
    (part,) = split_groups(blocks, slots, 4)
    assert part.group == 0 and part.first == 0
    assert part.blocks.tolist() == list(range(8)) and part.slots.tolist() == [5, 6]


def test_groups_starting_inside_a_chunk_take_one_more_chunk() -> None:
    # Group 0: 5 blocks from index 0 -> 2 chunks; group 1 (a sliding window):
    # 3 blocks from index 6 -> starts 2 blocks into a chunk, spans 2 chunks;
    # group 2: empty.
    blocks = np.arange(10, 18)
    slots = np.array([1, 2, 3, 4])
    parts = split_groups(blocks, slots, 4, group_sizes=[5, 3, 0], block_indices=[0, 6, 0])
    assert [(p.group, p.blocks.tolist(), p.slots.tolist(), p.first) for p in parts] == [
        (0, [10, 11, 12, 13, 14], [1, 2], 0),
        (1, [15, 16, 17], [3, 4], 6),
        (2, [], [], 0),
    ]


def test_chunk_bounds_cut_a_part_starting_inside_its_first_chunk() -> None:
    assert chunk_bounds(0, 8, 2, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(6, 3, 2, 4) == [(0, 2), (2, 3)]  # 2 blocks fill chunk 0's end
    assert chunk_bounds(5, 7, 2, 4) == [(0, 3), (3, 7)]


def test_runs_group_host_chunks_and_split_streamed_ones() -> None:
    assert list(runs(np.array([3, 4, -1, -1, 7, -1]))) == [
        (True, 0, 2),
        (False, 2, 3),
        (False, 3, 4),
        (True, 4, 5),
        (False, 5, 6),
    ]
    assert list(runs(np.array([], np.int64))) == []


def test_layer_ranges_in_layer_order() -> None:
    assert layer_ranges(6, 2) == [(0, 2), (2, 4), (4, 6)]
    assert layer_ranges(4, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
