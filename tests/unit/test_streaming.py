"""Loads streamed from the disk tier by the worker (kvtier.streaming): the
manager hands out disk hits that find no room in the host tier, and the
StreamLoader reads them into the KV cache through its staging ring. Layer
by layer, it reads each record as byte ranges in layer order and copies a
layer into the KV cache once its range arrived; the range that completes a
record checks it whole, so a corrupt record still fails its job."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtier.manager import TieredOffloadingManager
from kvtier.pool import HostPool
from kvtier.streaming import StreamChunk, StreamLoader
from kvtier.tiers import HostTier, LookupResult
from kvtier.tiers.disk import DiskTier
from kvtier.worker.transfer import DeviceTransfer

BLOCK = 4096
LAYERS, PER_LAYER = 4, 2  # layered loads: K and V per layer
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def K(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def settle(m: TieredOffloadingManager) -> None:
    deadline = time.monotonic() + 10
    while m.has_pending_work():
        assert time.monotonic() < deadline, "tier jobs did not finish"
        m.on_schedule_end()
        time.sleep(0.002)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[TieredOffloadingManager, DiskTier, HostPool]]:
    """4 host slots over a 64-record disk tier; keys 0-11 on disk, 8-11 also in the host."""
    pool = HostPool(4, DiskTier.slot_bytes_for(BLOCK))
    disk = DiskTier(tmp_path, 64 * DiskTier.slot_bytes_for(BLOCK), BLOCK, backend="pread")
    m = TieredOffloadingManager(HostTier(pool, 4), [disk], streaming=True)
    for first in (0, 4, 8):
        keys = [K(i) for i in range(first, first + 4)]
        out = m.prepare_store(keys)
        assert out is not None and out.keys_to_store == keys
        for k, s in zip(keys, out.store_spec.slots):
            pool.view(int(s))[:BLOCK] = k[31] + 1
        m.complete_store(keys)
        settle(m)
    assert [disk.lookup(K(i)) for i in range(12)] == [HIT] * 12
    yield m, disk, pool
    m.shutdown()
    pool.close()


def scan(m: TieredOffloadingManager, keys: list[bytes]) -> list[LookupResult]:
    return [m.lookup(k) for k in keys]


def test_disk_hits_without_host_room_are_streamed(setup) -> None:  # type: ignore[no-untyped-def]
    m, disk, _ = setup
    prefix = [K(i) for i in (8, 9, 10, 11, *range(8))]
    assert scan(m, prefix) == [HIT] * 12  # host full of this step's hits: the rest streams
    assert m.get_load_source(K(0)) == "disk" and m.get_load_source(K(8)) == "host"
    spec = m.prepare_load(prefix)
    assert (spec.slots[:4] >= 0).all() and (spec.slots[4:] == -1).all()
    st = spec.stream
    assert st is not None
    assert st.index.tolist() == list(range(4, 12)) and st.tiers == ["disk"] * 8
    assert st.digests == b"".join(disk_digest(k) for k in prefix[4:])
    assert m.stats.loaded_from == {"host": 4, "disk": 8} and m.stats.streamed == 8
    assert m.occupancy()["streaming"] == 8 and m.occupancy()["pinned"] == 4
    assert int(disk.rec_loading.sum()) == 8  # pinned: never evicted or reused meanwhile

    kv = np.zeros((16, BLOCK), np.uint8)
    loader = StreamLoader([([kv], [BLOCK])], blocks_per_chunk=1,
                          slot_bytes=setup[2].slot_bytes, num_slots=3)  # fmt: skip
    try:
        chunks = [StreamChunk(0, np.array([2 + n]), 4 + n, "disk", st.locations[n],
                              st.digests[16 * n : 16 * n + 16]) for n in range(8)]  # fmt: skip
        loader.submit(7, chunks, st.readers)
        loader.wait([7], timeout=10)
        (r,) = loader.get_finished()
        assert (r.job_id, r.success, r.transfer_size) == (7, True, 8 * BLOCK)
        for n in range(8):  # every byte where it belongs, through a ring of 3 slots
            assert (kv[2 + n] == n + 1).all()
        assert not kv[:2].any() and not kv[10:].any()
    finally:
        loader.close()
    m.complete_load(prefix)
    assert int(disk.rec_loading.sum()) == 0
    assert m.occupancy()["streaming"] == 0 and m.occupancy()["pinned"] == 0


def disk_digest(k: bytes) -> bytes:
    from kvtier.tiers.records import key_digest

    return key_digest(k)


def test_a_corrupt_record_fails_its_stream_job(setup) -> None:  # type: ignore[no-untyped-def]
    m, disk, pool = setup
    prefix = [K(i) for i in (8, 9, 10, 11, 0, 1)]
    assert scan(m, prefix) == [HIT] * 6
    spec = m.prepare_load(prefix)
    st = spec.stream
    assert st is not None
    _, file, offset = st.locations[1].tolist()
    fd = os.open(disk.paths[file], os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 64, offset + 100)  # K(1)'s payload, behind the tier's back
    finally:
        os.close(fd)
    kv = np.zeros((4, BLOCK), np.uint8)
    loader = StreamLoader([([kv], [BLOCK])], blocks_per_chunk=1, slot_bytes=pool.slot_bytes)
    try:
        chunks = [StreamChunk(0, np.array([n]), n, "disk", st.locations[n],
                              st.digests[16 * n : 16 * n + 16]) for n in range(2)]  # fmt: skip
        loader.submit(1, chunks, st.readers)
        loader.wait([1], timeout=10)
        (r,) = loader.get_finished()
        assert not r.success and "disk read failed" in r.error
        assert (kv[0] == 1).all()  # K(0) copied
        assert not kv[1].any()  # K(1) failed its check: never copied
    finally:
        loader.close()
    m.complete_load(prefix)
    assert int(disk.rec_loading.sum()) == 0


def test_without_streaming_a_full_host_ends_the_hit(setup) -> None:  # type: ignore[no-untyped-def]
    m, _, _ = setup
    m.options.streaming = False
    prefix = [K(i) for i in (8, 9, 10, 11, *range(8))]
    assert scan(m, prefix)[:5] == [HIT] * 4 + [MISS]
    assert m.stats.streamed == 0


def test_a_streamed_key_prepared_twice_is_unpinned_per_request(setup) -> None:  # type: ignore[no-untyped-def]
    """Two requests streaming the same record: each complete_load releases its own pin."""
    m, disk, _ = setup

    class Ctx:
        def __init__(self, rid: str) -> None:
            self.req_id = rid

    prefix = [K(i) for i in (8, 9, 10, 11, 0)]
    a, b = Ctx("a"), Ctx("b")
    assert scan(m, prefix) == [HIT] * 5
    m.prepare_load(prefix, a)
    m.prepare_load(prefix, b)
    assert int(disk.rec_loading.sum()) == 2
    m.complete_load(prefix, a)
    assert int(disk.rec_loading.sum()) == 1 and m.occupancy()["pinned"] == 4
    m.complete_load(prefix, b)
    assert int(disk.rec_loading.sum()) == 0 and m.occupancy()["pinned"] == 0


def test_offered_blocks_without_host_room_are_written_by_the_worker(tmp_path: Path) -> None:
    pool = HostPool(4, DiskTier.slot_bytes_for(BLOCK))
    disk = DiskTier(tmp_path, 64 * DiskTier.slot_bytes_for(BLOCK), BLOCK, backend="pread")
    m = TieredOffloadingManager(HostTier(pool, 4), [disk], streaming=True, streaming_stores=True)
    kv = np.zeros((8, BLOCK), np.uint8)
    for b in range(8):
        kv[b] = 10 + b
    loader = StreamLoader([([kv], [BLOCK])], blocks_per_chunk=1, slot_bytes=pool.slot_bytes,
                          num_slots=1)  # fmt: skip
    try:
        keys = [K(i) for i in range(6)]
        out = m.prepare_store(keys)
        assert out is not None and out.keys_to_store == keys
        spec = out.store_spec
        assert spec.slots[:4].tolist() != [-1] * 4 and spec.slots[4:].tolist() == [-1, -1]
        st = spec.stream
        assert st is not None and st.index.tolist() == [4, 5]
        assert disk.lookup(K(4)) is MISS  # reserved, not readable before the write ends
        chunks = [StreamChunk(0, np.array([4 + n]), 4 + n, "disk", st.locations[n],
                              st.digests[16 * n : 16 * n + 16]) for n in range(2)]  # fmt: skip
        loader.submit(3, chunks, st.readers, store=True)
        loader.wait([3], timeout=10)
        (r,) = loader.get_finished()
        assert (r.job_id, r.success) == (3, True)
        m.complete_store(keys)
        assert disk.lookup(K(4)) is HIT and disk.lookup(K(5)) is HIT
        assert m.stats.streamed_stores == 2 and m.occupancy()["streaming"] == 0
        assert m.host.get(K(4)) is None and m.host.get(K(0)) is not None

        # Read back through the worker: the bytes of blocks 4 and 5.
        back = np.zeros((2, BLOCK), np.uint8)
        locs, digs = disk.pin_for_read([K(4), K(5)])
        reader = StreamLoader([([back], [BLOCK])], blocks_per_chunk=1, slot_bytes=pool.slot_bytes)
        try:
            reader.submit(1, [StreamChunk(0, np.array([n]), n, "disk", locs[n],
                                          digs[16 * n : 16 * n + 16]) for n in range(2)],
                          st.readers)  # fmt: skip
            reader.wait([1], timeout=10)
            assert reader.get_finished()[0].success
        finally:
            reader.close()
        disk.unpin_read(locs[:, 0].tolist())
        assert (back[0] == 14).all() and (back[1] == 15).all()
    finally:
        loader.close()
        m.shutdown()
        pool.close()


def test_a_failed_worker_write_frees_its_record(tmp_path: Path) -> None:
    pool = HostPool(2, DiskTier.slot_bytes_for(BLOCK))
    disk = DiskTier(tmp_path, 8 * DiskTier.slot_bytes_for(BLOCK), BLOCK, backend="pread")
    m = TieredOffloadingManager(HostTier(pool, 2), [disk], streaming=True, streaming_stores=True)
    try:
        keys = [K(i) for i in range(3)]
        out = m.prepare_store(keys)
        assert out is not None and out.store_spec.slots.tolist()[2] == -1
        free_before = disk.free_records
        m.complete_store(keys, success=False)
        assert disk.lookup(K(2)) is MISS and disk.free_records == free_before + 1
        assert m.occupancy()["streaming"] == 0
    finally:
        m.shutdown()
        pool.close()


def test_without_promotion_every_disk_hit_streams(setup) -> None:  # type: ignore[no-untyped-def]
    """promote=False: a disk hit is streamed even where promoting it would
    have found a slot (by evicting ready host blocks), and nothing is evicted."""
    m, _, _ = setup
    m.options.promote = False
    assert scan(m, [K(0), K(1)]) == [HIT, HIT]
    assert m.get_load_source(K(0)) == "disk"
    spec = m.prepare_load([K(0), K(1)])
    assert spec.slots.tolist() == [-1, -1] and m.stats.promotions == 0
    assert all(m.host.get(K(i)) is not None for i in (8, 9, 10, 11))
    m.complete_load([K(0), K(1)])
    assert m.occupancy()["streaming"] == 0


def test_redis_hits_and_stores_stream_too(redis_standalone) -> None:  # type: ignore[no-untyped-def]
    """A Redis tier (with worker_io) under a 4-slot host tier: offered blocks
    that find no host slot are written to Redis by the worker, and hits that
    find none are read back by it, byte for byte. Without worker_io the
    tier offers no reader: a full host tier ends its hits there."""
    from kvtier.tiers.remote import RemoteTier

    redis_standalone.cli("FLUSHALL")
    slot = DiskTier.slot_bytes_for(BLOCK)
    pool = HostPool(4, slot)
    plain = RemoteTier(redis_standalone.url, BLOCK, namespace="x")
    plain.attach(pool)
    assert plain.reader_spec() is None
    plain.close()
    remote = RemoteTier(redis_standalone.url, BLOCK, namespace="stream-test", worker_io=True)
    m = TieredOffloadingManager(HostTier(pool, 4), [remote], streaming=True, streaming_stores=True)
    kv = np.zeros((10, BLOCK), np.uint8)
    for b in range(10):
        kv[b] = 20 + b
    loader = StreamLoader([([kv], [BLOCK])], blocks_per_chunk=1, slot_bytes=slot, num_slots=2)
    try:
        keys = [K(i) for i in range(10)]
        out = m.prepare_store(keys)
        assert out is not None and out.keys_to_store == keys
        st = out.store_spec.stream
        assert st is not None and st.index.tolist() == list(range(4, 10))
        loader.submit(1, [StreamChunk(0, np.array([4 + n]), 4 + n, "remote", st.locations[n],
                                      st.digests[16 * n : 16 * n + 16]) for n in range(6)],
                      st.readers, store=True)  # fmt: skip
        loader.wait([1], timeout=10)
        assert loader.get_finished()[0].success
        m.complete_store(keys)
        assert m.occupancy()["streaming"] == 0
        assert remote.lookup(K(4)) is HIT  # known from the write

        kv[:] = 0
        prefix = [K(i) for i in range(10)]
        # Host keys 0-3 wait for their cascade (staged until the step ends),
        # so nothing can be evicted to promote into: the hits stream.
        assert scan(m, prefix[4:]) == [HIT] * 6
        spec = m.prepare_load(prefix[4:])
        st = spec.stream
        assert st is not None and st.tiers == ["remote"] * 6
        loader.submit(2, [StreamChunk(0, np.array([n]), n, "remote", st.locations[n],
                                      st.digests[16 * n : 16 * n + 16]) for n in range(6)],
                      st.readers)  # fmt: skip
        loader.wait([2], timeout=10)
        assert loader.get_finished()[0].success
        for n in range(6):
            assert (kv[n] == 24 + n).all()
        m.complete_load(prefix[4:])
        assert m.occupancy()["streaming"] == 0
    finally:
        loader.close()
        m.shutdown()
        pool.close()


class Disk:
    """8 chunks of random KV on a disk tier only (a 4-slot host tier pushed
    them out), as ``bpc`` blocks of ``LAYERS * PER_LAYER`` tensors of
    ``page`` bytes each; ``src`` holds their bytes, chunk n in blocks
    ``[n * bpc, (n + 1) * bpc)``."""

    def __init__(self, tmp_path: Path, page: int, bpc: int) -> None:
        self.page, self.bpc = page, bpc
        self.block = LAYERS * PER_LAYER * page * bpc  # a chunk's payload
        rng = np.random.default_rng(page + bpc)
        self.src = [
            rng.integers(0, 256, (8 * bpc, page), np.uint8) for _ in range(LAYERS * PER_LAYER)
        ]
        self.pool = HostPool(4, DiskTier.slot_bytes_for(self.block))
        self.disk = DiskTier(tmp_path, 32 * DiskTier.slot_bytes_for(self.block), self.block,
                             backend="pread")  # fmt: skip
        self.m = TieredOffloadingManager(HostTier(self.pool, 4), [self.disk], streaming=True)
        fill = DeviceTransfer(self.src, self.pool, blocks_per_chunk=bpc, num_threads=1)
        try:
            for first in (0, 4, 8):
                keys = [K(i) for i in range(first, first + 4)]
                out = self.m.prepare_store(keys)
                assert out is not None and out.keys_to_store == keys
                blocks = np.arange(first * bpc, min(first + 4, 8) * bpc) if first < 8 else None
                if blocks is not None:
                    assert fill.submit_store(first, blocks, out.store_spec.slots)
                    fill.wait([first])
                    assert all(r.success for r in fill.get_finished())
                self.m.complete_store(keys)
                settle(self.m)
        finally:
            fill.shutdown()
        self.m.options.promote = False  # every disk hit streams
        assert [self.m.lookup(K(i)) for i in range(8)] == [HIT] * 8
        assert [self.m.get_load_source(K(i)) for i in range(8)] == ["disk"] * 8

    def close(self) -> None:
        self.m.shutdown()
        self.pool.close()


def chunks(st, dst_first: int, bpc: int, last_blocks: int) -> list[StreamChunk]:  # type: ignore[no-untyped-def]
    """The 8 streamed chunks into engine blocks from ``dst_first`` on; the
    last one only partly covered (``last_blocks`` of its blocks)."""
    out = []
    for n in range(8):
        nb = last_blocks if n == 7 else bpc
        blocks = np.arange(dst_first + n * bpc, dst_first + n * bpc + nb)
        out.append(StreamChunk(0, blocks, n * bpc, "disk", st.locations[n],
                               st.digests[16 * n : 16 * n + 16]))  # fmt: skip
    return out


@pytest.mark.parametrize(("page", "bpc"), [(5000, 1), (4096, 2), (3000, 3)])
def test_a_layered_stream_load_is_byte_for_byte_and_ready_layer_by_layer(
    tmp_path: Path, page: int, bpc: int
) -> None:
    """Pages that do not fall on 4 KiB boundaries (a layer's bytes span two
    ranges), chunks of several blocks, a partly covered last chunk; a ring
    smaller than the load (the later chunks come in a second round)."""
    d = Disk(tmp_path, page, bpc)
    keys = [K(i) for i in range(8)]
    spec = d.m.prepare_load(keys)
    st = spec.stream
    assert st is not None and (spec.slots == -1).all()
    dst = [np.zeros((9 * bpc, page), np.uint8) for _ in range(LAYERS * PER_LAYER)]
    loader = StreamLoader([(dst, [page] * len(dst))], blocks_per_chunk=bpc,
                          slot_bytes=d.pool.slot_bytes, num_slots=5, min_range_bytes=4096)  # fmt: skip
    last = max(1, bpc - 1)
    try:
        loader.submit(7, chunks(st, bpc, bpc, last), st.readers, layers=[PER_LAYER])
        got = np.concatenate([np.arange(n * bpc, n * bpc + bpc) for n in range(7)]
                             + [np.arange(7 * bpc, 7 * bpc + last)])  # fmt: skip
        for layer in range(LAYERS):
            loader.wait_layer(7, 0, layer, timeout=10)
            for t in range(layer * PER_LAYER, (layer + 1) * PER_LAYER):
                assert np.array_equal(dst[t][bpc + got], d.src[t][got])
        loader.wait([7], timeout=10)
        (r,) = loader.get_finished()
        n_blocks = 7 * bpc + last
        assert (r.job_id, r.success) == (7, True)
        assert r.transfer_size == n_blocks * LAYERS * PER_LAYER * page
        for t in range(LAYERS * PER_LAYER):  # nothing else written
            assert np.array_equal(dst[t][bpc + got], d.src[t][got])
            assert not dst[t][:bpc].any() and not dst[t][bpc + n_blocks :].any()
        (plan,) = loader._plans.values()
        assert len(plan.ranges) > 1  # really read by ranges
        assert loader.pool.num_slots == 5
    finally:
        loader.close()
        d.m.complete_load(keys)
        d.close()


@pytest.mark.parametrize("where", ["first layer", "last layer"])
def test_a_corrupt_record_read_by_ranges_fails_its_job(tmp_path: Path, where: str) -> None:
    """A record changed behind the tier's back: its first layer may already
    be in the KV cache when its last range checks it, so the job fails
    (the worker reports its blocks for recomputing); the other chunks'
    bytes are right."""
    page = 4096
    d = Disk(tmp_path, page, 1)
    keys = [K(i) for i in range(8)]
    spec = d.m.prepare_load(keys)
    st = spec.stream
    assert st is not None
    _, file, offset = st.locations[3].tolist()
    at = 100 if where == "first layer" else (LAYERS - 1) * PER_LAYER * page + 100
    fd = os.open(d.disk.paths[file], os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 64, offset + at)
    finally:
        os.close(fd)
    dst = [np.zeros((8, page), np.uint8) for _ in range(LAYERS * PER_LAYER)]
    loader = StreamLoader([(dst, [page] * len(dst))], blocks_per_chunk=1,
                          slot_bytes=d.pool.slot_bytes, min_range_bytes=4096)  # fmt: skip
    try:
        loader.submit(1, chunks(st, 0, 1, 1), st.readers, layers=[PER_LAYER])
        for layer in range(LAYERS):
            loader.wait_layer(1, 0, layer, timeout=10)  # never hangs on the failed chunk
        loader.wait([1], timeout=10)
        (r,) = loader.get_finished()
        assert not r.success and "disk read failed" in r.error
        others = [n for n in range(8) if n != 3]
        for t in range(LAYERS * PER_LAYER):
            assert np.array_equal(dst[t][others], d.src[t][others])
        # The bad chunk's last layer is copied only after the check: never.
        assert not dst[-1][3].any()
    finally:
        loader.close()
        d.m.complete_load(keys)
        d.close()


def test_without_layers_or_from_a_tier_without_ranges_a_load_stays_whole(tmp_path: Path) -> None:
    """A load submitted without ``layers`` reads whole records (no plan);
    wait_layer on it waits for the whole job."""
    d = Disk(tmp_path, 4096, 1)
    keys = [K(i) for i in range(8)]
    st = d.m.prepare_load(keys).stream
    assert st is not None
    dst = [np.zeros((8, 4096), np.uint8) for _ in range(LAYERS * PER_LAYER)]
    loader = StreamLoader([(dst, [4096] * len(dst))], blocks_per_chunk=1,
                          slot_bytes=d.pool.slot_bytes)  # fmt: skip
    try:
        loader.submit(2, chunks(st, 0, 1, 1), st.readers)
        loader.wait_layer(2, 0, 0, timeout=10)
        assert all(np.array_equal(a, b) for a, b in zip(dst, d.src))
        (r,) = loader.get_finished()
        assert r.success and not loader._plans
    finally:
        loader.close()
        d.m.complete_load(keys)
        d.close()
