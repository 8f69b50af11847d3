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
