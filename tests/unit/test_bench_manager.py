"""``kvtier bench manager``'s cycle of a key's life (returning_cycles): every
key stored once and, ``lag`` calls later, found and loaded once; exact
counts, in-process."""

from __future__ import annotations

from kvtier.bench.manager import returning_cycles
from kvtier.scheduler.manager import TieredOffloadingManager
from kvtier.tiers.host_native import make_host_tier


def test_a_keys_life_stores_and_then_finds_and_loads_every_key_once() -> None:
    n, batch, lag = 2000, 16, 4
    keys = [i.to_bytes(32, "little") + bytes(4) for i in range(n)]
    m = TieredOffloadingManager(make_host_tier(None, n // 2))
    rate, missed = returning_cycles(m, keys, batch, lag)
    assert rate > 0 and missed == 0
    assert m.stats.stores == n and m.stats.loads == n
    assert m.stats.lookups["hit"] == n  # every returning key
    assert m.stats.lookups["miss"] == n // batch  # each storing scan stops at its first
    assert m.occupancy()["pinned"] == 0


def test_keys_the_manager_lost_are_counted_as_missed() -> None:
    n, batch, lag = 640, 16, 8
    keys = [i.to_bytes(32, "little") + bytes(4) for i in range(n)]
    # Room for 4 calls' keys: most are evicted before they return 8 calls later.
    m = TieredOffloadingManager(make_host_tier(None, 4 * batch))
    _, missed = returning_cycles(m, keys, batch, lag)
    assert missed > n // 2  # most were evicted before they came back
    assert missed + m.stats.loads == n  # each returning key loaded or counted


def test_a_processes_cpu_time_is_read_for_itself_and_for_a_child() -> None:
    """process_cpu_s, which splits ``bench manager --node``'s cost between
    the node and its client: a child that used 0.2 s of CPU reads at least
    that (less a clock tick), this process counts its own work, and a
    process that is gone is an OSError."""
    import subprocess
    import sys

    import pytest
    from kvtier.bench.harness import process_cpu_s

    burn = "import time\nwhile time.process_time() < 0.2: pass\nprint(flush=True)\ninput()"
    child = subprocess.Popen(
        [sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "\n"
        assert process_cpu_s(child.pid) >= 0.2 - 0.02
    finally:
        child.communicate("\n")
    with pytest.raises(OSError):
        process_cpu_s(child.pid)
    t0 = process_cpu_s()
    sum(range(2_000_000))
    assert process_cpu_s() > t0


def test_the_node_benchs_cpu_figures_are_each_sides_medians_and_their_ratios() -> None:
    """``kvtier bench manager --node``'s CPU figures: each side's median CPU
    a key, what one core of the node serves against the in-process manager
    (its CPU a key over the node's), and the clients' and node's CPU a key
    together over the in-process manager's; a ratio over no CPU is left out."""
    from kvtier.bench.node import cpu_figures

    cpu = {
        "in_process": [0.2, 0.16, 0.18],  # 1.8 us a key over 100,000 keys
        "client": [0.25, 0.24, 0.26],
        "node": [0.22, 0.2, 0.21],
        "clients_many": [0.3, 0.28, 0.29],  # 2.9 us
        "node_many": [0.12, 0.1, 0.11],  # 1.1 us
    }
    out = cpu_figures(cpu, 100_000, 4, 16)
    assert out == {
        "cpu_us_per_key_in_process_batch16": 1.8,
        "cpu_us_per_key_client_batch16": 2.5,
        "cpu_us_per_key_node_batch16": 2.1,
        "cpu_us_per_key_clients_4_clients_batch16": 2.9,
        "cpu_us_per_key_node_4_clients_batch16": 1.1,
        "node_capacity_ratio_4_clients_batch16": round(1.8 / 1.1, 3),
        "cpu_ratio_4_clients_batch16": round((2.9 + 1.1) / 1.8, 2),
    }
    cpu["node_many"] = [0.0]  # under the clock's tick
    assert "node_capacity_ratio_4_clients_batch16" not in cpu_figures(cpu, 100_000, 4, 16)
