"""kvtier's SGLang backend with its memory tier (``kvtier_host_bytes``) in
front of the disk: pages read back from memory byte for byte, the disk
untouched by those reads, least recently used pages evicted first, a bad
size refused, ``clear`` and the key-value fallbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

hs = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="sglang is not installed (make venv installs sglang==0.5.23 --no-deps)",
)
torch = pytest.importorskip("torch")

from kvtier.bench.sglang_standin import page_bytes, token_indices  # noqa: E402
from kvtier.errors import InvalidArgument  # noqa: E402
from kvtier.integrations.sglang import parse_extra_config  # noqa: E402


def extra(tmp_path: Path, pages: int | None, slot: int) -> dict[str, Any]:
    e: dict[str, Any] = {"kvtier_disk_path": str(tmp_path / "kv"), "kvtier_disk_bytes": "64MiB"}
    if pages is not None:
        e["kvtier_host_bytes"] = pages * slot
    return e


def slot_size(sglang_filled: Any, tmp_path: Path) -> int:
    """Bytes of one memory slot: a page and its disk trailer (a disk record)."""
    _, s = sglang_filled(extra(tmp_path / "probe", None, 0), 0)
    return int(s.movers["kv"].slot_bytes)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_come_back_from_memory_and_the_disk_is_not_read(
    layout: str, sglang_filled: Any, tmp_path: Path
) -> None:
    slot = slot_size(sglang_filled, tmp_path)
    pool, s = sglang_filled(extra(tmp_path, 8, slot), 1, layout=layout)
    keys = [f"m{i}" for i in range(5)]
    assert s.batch_set_v1(keys, token_indices(pool, 0, 5)) == [True] * 5
    assert s.batch_exists(keys + ["absent"]) == 5
    assert s.batch_get_v1(keys, token_indices(pool, 8, 5)) == [True] * 5
    assert [page_bytes(pool, 8 + i) for i in range(5)] == [page_bytes(pool, i) for i in range(5)]
    st = s.kvtier_stats()["kv"]
    assert (st["host_pages_stored"], st["host_pages_loaded"], st["host_pages"]) == (5, 5, 5)
    assert st["tiers"]["disk"]["loads"] == 0  # every page from memory
    assert st["tiers"]["disk"]["stores"] == 5  # and every page on disk too


def test_the_least_recently_used_pages_leave_memory_and_come_from_disk(
    sglang_filled: Any, tmp_path: Path
) -> None:
    slot = slot_size(sglang_filled, tmp_path)
    pool, s = sglang_filled(extra(tmp_path, 4, slot), 2)
    first = [f"a{i}" for i in range(4)]
    assert s.batch_set_v1(first, token_indices(pool, 0, 4)) == [True] * 4
    # a0 used again: a1 and a2 are the two least recently used.
    assert s.batch_get_v1(["a0"], token_indices(pool, 8, 1)) == [True]
    assert s.batch_set_v1(["b0", "b1"], token_indices(pool, 4, 2)) == [True] * 2
    mem = s.movers["kv"].host_pages
    assert mem.keys() == [b"a3", b"a0", b"b0", b"b1"]  # least recently used first
    assert s.kvtier_stats()["kv"]["host_evictions"] == 2
    # All six still load, the two evicted ones from disk, byte for byte.
    keys = first + ["b0", "b1"]
    assert s.batch_get_v1(keys, token_indices(pool, 8, 6)) == [True] * 6
    want = [page_bytes(pool, i) for i in range(6)]
    assert [page_bytes(pool, 8 + i) for i in range(6)] == want
    st = s.kvtier_stats()["kv"]
    assert (st["host_pages_loaded"], st["tiers"]["disk"]["loads"]) == (1 + 4, 2)


def test_a_page_in_memory_is_found_after_the_disk_lost_it(
    sglang_filled: Any, tmp_path: Path
) -> None:
    slot = slot_size(sglang_filled, tmp_path)
    pool, s = sglang_filled(extra(tmp_path, 4, slot), 3)
    assert s.batch_set_v1(["c0", "c1"], token_indices(pool, 0, 2)) == [True] * 2
    s.movers["kv"].tiers[0].reset()  # the disk forgets both records
    assert s.batch_exists(["c0", "c1"]) == 2
    assert s.batch_get_v1(["c0", "c1"], token_indices(pool, 8, 2)) == [True] * 2
    assert [page_bytes(pool, 8), page_bytes(pool, 9)] == [page_bytes(pool, 0), page_bytes(pool, 1)]


def test_clear_empties_memory_and_the_key_value_calls_use_it(
    sglang_filled: Any, tmp_path: Path
) -> None:
    slot = slot_size(sglang_filled, tmp_path)
    pool, s = sglang_filled(extra(tmp_path, 4, slot), 4)
    page = len(page_bytes(pool, 0))
    data = torch.arange(page, dtype=torch.uint8) ^ 0x5A
    assert s.set("kv0", data) is True
    assert s.kvtier_stats()["kv"]["host_pages"] == 1
    s.movers["kv"].tiers[0].reset()  # only memory holds it now
    got = s.get("kv0", torch.zeros(page, dtype=torch.uint8))
    assert got is not None and bytes(got.numpy()) == bytes(data.numpy())
    s.clear()
    assert s.kvtier_stats()["kv"]["host_pages"] == 0
    assert s.batch_exists(["kv0"]) == 0
    assert s.get("kv0", torch.zeros(page, dtype=torch.uint8)) is None


def test_a_memory_tier_smaller_than_a_page_is_refused(sglang_filled: Any, tmp_path: Path) -> None:
    slot = slot_size(sglang_filled, tmp_path)
    with pytest.raises(InvalidArgument, match=r"kvtier_host_bytes \d+ holds no page"):
        sglang_filled({**extra(tmp_path, None, slot), "kvtier_host_bytes": slot - 1}, 5)
    with pytest.raises(InvalidArgument, match="kvtier_host_bytes: must be > 0"):
        parse_extra_config({**extra(tmp_path, None, slot), "kvtier_host_bytes": -1})
    assert parse_extra_config(extra(tmp_path, None, slot)).host_bytes == 0
    assert (
        parse_extra_config({**extra(tmp_path, None, slot), "kvtier_host_bytes": "1MiB"}).host_bytes
        == 1 << 20
    )


def test_pinned_pages_stay_and_held_slots_wait_for_their_job() -> None:
    from kvtier.integrations.sglang.host_pages import HostPages
    from kvtier.pool import HostPool

    pool = HostPool(6, 4096)
    try:
        hp = HostPages(3, pool, first=3)  # pool slots 3, 4, 5
        assert hp.reserve([b"a", b"b", b"a", b"c"]) == [(0, 3), (1, 4), (3, 5)]
        assert not hp.holds(b"a")  # being written: invisible
        hp.commit([b"a", b"b", b"c"])
        assert hp.pin([b"a", b"x"]) == [3, None]
        # Full: the least recently used unpinned page (b) goes, pinned a stays.
        assert hp.reserve([b"d"]) == [(0, 4)]
        hp.commit([b"d"])
        assert hp.keys() == [b"c", b"a", b"d"]
        hp.unpin([b"a"], loaded=1)
        # A slot a timed-out job still reads is not handed out again.
        hp.held.hold(5)
        # c is evicted for e, but its slot 5 stays out of use until the job ends.
        assert hp.reserve([b"e"]) == []
        assert (hp.keys(), hp.holds(b"c")) == ([b"a", b"d"], False)
        hp.held.unhold(5)
        assert hp.reserve([b"f"]) == [(0, 5)]
        hp.abort([b"f"])
        assert (hp.holds(b"f"), hp._free) == (False, [5])
        assert (hp.counters["host_evictions"], hp.counters["host_pages_loaded"]) == (2, 1)
    finally:
        pool.close()


def test_the_mover_keeps_held_staging_and_memory_slots_out_of_use_until_released(
    sglang_filled: Any, tmp_path: Path
) -> None:
    from kvtier.tiers.base import TierCompletion

    slot = slot_size(sglang_filled, tmp_path)
    pool, s = sglang_filled(extra(tmp_path, 2, slot), 6)
    m = s.movers["kv"]
    disk = m.tiers[0]
    staging = m._free["store"]
    assert s.batch_set_v1(["h0", "h1"], token_indices(pool, 0, 2)) == [True] * 2
    (mem0,) = m.host_pages.pin([b"h0"])
    m.host_pages.unpin([b"h0"], 0)
    # A timed-out job still touches staging slot 0 (twice: two jobs) and h0's memory slot.
    c = TierCompletion(token=0, ok=False, kind="store", keys=[b"x", b"y", b"h0"], held=[True] * 3)
    m._note_held(c, [staging[0], staging[0], mem0])
    assert staging[0] not in m._take_slots("store", len(staging))
    # Two new pages evict h0 and h1, but h0's slot is held: only n0 finds one
    # (h1's), n1 goes to the disk alone.
    assert s.batch_set_v1(["n0", "n1"], token_indices(pool, 2, 2)) == [True] * 2
    assert (m.host_pages.keys(), m.host_pages._free) == ([b"n0"], [])

    def release(slots: list[int]) -> None:
        disk.take_released_slots = lambda: slots  # type: ignore[method-assign]
        with m._lock:
            m._drain(disk)

    release([staging[0]])  # one of the two jobs ended: still held
    assert staging[0] not in m._take_slots("store", len(staging))
    release([staging[0], mem0])
    assert staging[0] in m._take_slots("store", len(staging))
    assert m.host_pages._free == [mem0]  # the evicted page's slot, free at last
    # Every page still reads back byte for byte (from memory or the disk).
    keys = ["h0", "h1", "n0", "n1"]
    assert s.batch_get_v1(keys, token_indices(pool, 8, 4)) == [True] * 4
    assert [page_bytes(pool, 8 + i) for i in range(4)] == [page_bytes(pool, i) for i in range(4)]
