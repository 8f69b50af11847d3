"""`kvtier bench manager --node` compares like work only when every key
comes back: at a small key count its node must still hold every engine's
keys in flight (the bench's own returning-miss count says so)."""

from __future__ import annotations

from kvtier.bench.node import node_blocks_needed, run_node_manager


def test_a_small_node_bench_returns_every_key() -> None:
    # 8,192 keys: half of them is fewer blocks than four engines keep in
    # flight (4,080 returning keys missed before the node was sized for them).
    out = run_node_manager(num_keys=8192, repeats=1, clients=4, shared_index=True)
    assert (out["returning_misses_batch1"], out["returning_misses_batch16"]) == (0, 0)
    assert out["node_host_blocks"] == node_blocks_needed(4) > out["host_blocks"] == 4096
