"""DeviceTransfer on a real GPU, byte for byte: every KV layout the
integrations produce, whole chunks and partial first chunks, the batched and
the per-copy path, random block ids and slots; a pool whose slot spans its
first GiB; two transfers over one pool. Each test syncs the GPU before it
submits: ordering against torch's streams is test_cuda_ordering.py's."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from gpu import cuda_case as case

case.skip_without_gpu()

import torch  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402
from kvtier.worker.transfer import DeviceTransfer  # noqa: E402

NB = 48  # KV blocks per tensor
MOVED = 10  # blocks per round trip


@pytest.fixture(autouse=True, scope="module")
def _real_runtime(request: pytest.FixtureRequest) -> None:
    case.require_own_process(request)


@pytest.mark.parametrize("use_batch", [True, False], ids=["batched", "per_copy"])
@pytest.mark.parametrize("bpc", [1, 4], ids=["bpc1", "bpc4"])
@pytest.mark.parametrize("name", case.LAYOUTS)
def test_round_trip_byte_for_byte(name: str, bpc: int, use_batch: bool) -> None:
    lay = case.make_layout(name, NB, seed=case.LAYOUTS.index(name))
    rng = np.random.default_rng([case.LAYOUTS.index(name), bpc, int(use_batch)])
    blocks = rng.permutation(NB)[:MOVED]
    first = 2 if bpc > 1 else 0  # a request's first chunk partly covered
    nchunks = -(-(first % bpc + MOVED) // bpc)
    nslots = 16
    slots = rng.permutation(nslots)[:nchunks]
    # A tail past the chunk: nothing may write there.
    slot_bytes = sum(lay.page_bytes) * bpc + 256
    with HostPool(nslots, slot_bytes) as pool:
        host = pool.view(0, nslots)
        host[:] = case.POISON_HOST
        before = [case.snapshot(t) for t in lay.tensors]
        torch.cuda.synchronize()
        t = DeviceTransfer(lay.tensors, pool, blocks_per_chunk=bpc, page_bytes=lay.page_arg,
                           use_batch=use_batch)  # fmt: skip
        try:
            assert t.backend == "cuda"
            assert t.submit_store(1, blocks, slots, first_block_index=first)
            r = case.finish(t, [1])[1]
            assert r.success, r.error
            assert r.transfer_size == MOVED * sum(lay.page_bytes)
            want = case.expected_slots(
                before, lay.page_bytes, blocks, slots, bpc, first, (nslots, slot_bytes)
            )
            case.assert_bytes_equal(host, want, "host slots after the store")

            dst = rng.permutation(NB)[:MOVED]  # may overlap the stored blocks
            case.poison_blocks(lay.tensors, dst)
            poisoned = [case.snapshot(x) for x in lay.tensors]
            torch.cuda.synchronize()
            assert t.submit_load(2, slots, dst, first_block_index=first)
            r = case.finish(t, [2])[2]
            assert r.success, r.error
            for i, (x, page) in enumerate(zip(lay.tensors, lay.page_bytes)):
                # Read right after wait(): the bytes are final without a sync.
                want = poisoned[i].copy()
                want[dst, :page] = before[i][blocks, :page]  # padding stays poisoned
                case.assert_bytes_equal(case.snapshot(x), want, f"KV tensor {i} after the load")
        finally:
            t.shutdown()


@pytest.mark.parametrize("use_batch", [True, False], ids=["batched", "per_copy"])
def test_the_path_asked_for_is_the_one_that_ran(use_batch: bool) -> None:
    from kvtier.worker import cuda_runtime

    _, version, has_batch, _ = cuda_runtime.load()
    lay = case.make_layout("per_layer", NB)
    with HostPool(8, sum(lay.page_bytes)) as pool:
        torch.cuda.synchronize()
        t = DeviceTransfer(lay.tensors, pool, use_batch=use_batch)
        try:
            s0 = t.stats()
            assert t.submit_store(1, [3, 17, 5, 40], [6, 0, 3, 1])
            case.assert_ok(t, [1])
            s1 = t.stats()
            copies = 4 * len(lay.tensors)
            if use_batch and has_batch and version >= 12080:
                assert s1["batch_calls"] > s0["batch_calls"], (s0, s1)
                assert s1["memcpy_calls"] == s0["memcpy_calls"], (s0, s1)
            else:
                assert s1["memcpy_calls"] - s0["memcpy_calls"] == copies, (s0, s1)
                assert s1["batch_calls"] == s0["batch_calls"], (s0, s1)
            assert s1["runtime"], s1
        finally:
            t.shutdown()


SLOT = (1 << 20) + 4096  # slots that do not divide 1 GiB
SLOTS = 1030  # 1.04 GiB: slot 1020 spans the pool's first GiB boundary


@pytest.fixture(scope="module")
def big_pool() -> Iterator[HostPool]:
    need = SLOT * SLOTS
    if case.shm_free_bytes() < need + (64 << 20):
        pytest.skip(
            f"/dev/shm has {case.shm_free_bytes() >> 20} MiB free, the pool needs {need >> 20}"
        )
    with HostPool(SLOTS, SLOT) as pool:
        yield pool


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_batch", [True, False], ids=["batched", "per_copy"])
def test_a_slot_across_the_first_gib_of_a_large_pool(big_pool: HostPool, use_batch: bool) -> None:
    crossing = (1 << 30) // SLOT
    assert crossing * SLOT < 1 << 30 < (crossing + 1) * SLOT
    slots = np.array([crossing, 0, SLOTS - 1])  # across the boundary, first, last
    gen = torch.Generator(device="cuda").manual_seed(7)
    kv = torch.randint(0, 256, (8, SLOT), dtype=torch.uint8, device="cuda", generator=gen)
    before = case.snapshot(kv)
    for s in slots.tolist():
        big_pool.view(s)[:] = case.POISON_HOST
    torch.cuda.synchronize()
    t = DeviceTransfer([kv], big_pool, use_batch=use_batch)
    try:
        blocks = np.array([3, 5, 7])
        assert t.submit_store(1, blocks, slots)
        case.assert_ok(t, [1])
        for b, s in zip(blocks.tolist(), slots.tolist()):
            case.assert_bytes_equal(big_pool.view(s), before[b], f"slot {s} after the store")
        dst = np.array([0, 1, 2])
        case.poison_blocks([kv], dst)
        torch.cuda.synchronize()
        assert t.submit_load(2, slots, dst)
        case.assert_ok(t, [2])
        case.assert_bytes_equal(case.snapshot(kv)[dst], before[blocks], "blocks after the load")
    finally:
        t.shutdown()


def _round_trip(t: DeviceTransfer, kv: list[torch.Tensor], slots: list[int], job: int) -> None:
    """Store 4 random blocks into ``slots``, poison 4 others, load them back; bytes checked."""
    rng = np.random.default_rng(job)
    src, dst = np.split(rng.permutation(NB)[:8], 2)
    before = [case.snapshot(x) for x in kv]
    torch.cuda.synchronize()
    assert t.submit_store(job, src, slots)
    case.assert_ok(t, [job])
    case.poison_blocks(kv, dst)
    torch.cuda.synchronize()
    assert t.submit_load(job + 1, slots, dst)
    case.assert_ok(t, [job + 1])
    for i, x in enumerate(kv):
        case.assert_bytes_equal(case.snapshot(x)[dst], before[i][src], f"job {job}: tensor {i}")


def test_two_transfers_over_one_pool_and_one_shut_down() -> None:
    # vLLM's worker makes one DeviceTransfer per KV-cache group over one pool.
    a = case.make_layout("per_layer", NB, seed=1)
    b = case.make_layout("mla_latent", NB, seed=2)
    slot = max(sum(a.page_bytes), sum(b.page_bytes))
    with HostPool(16, slot) as pool:
        pinned = pool.tensor(0)  # torch asks the runtime: registered memory counts as pinned
        torch.cuda.synchronize()
        ta = DeviceTransfer(a.tensors, pool)
        tb = DeviceTransfer(b.tensors, pool)
        tc = None
        try:
            # Both in flight at once, on different slots.
            assert ta.submit_store(1, [1, 2], [0, 1]) and tb.submit_store(1, [3, 4], [8, 9])
            case.assert_ok(ta, [1])
            case.assert_ok(tb, [1])
            _round_trip(ta, a.tensors, [2, 3, 4, 5], 10)
            _round_trip(tb, b.tensors, [10, 11, 12, 13], 10)
            ta.shutdown()
            assert pinned.is_pinned(), (
                "shutting one transfer down unpinned the pool under the other"
            )
            _round_trip(tb, b.tensors, [2, 3, 4, 5], 20)
            tc = DeviceTransfer(a.tensors, pool)  # over the pool again, beside tb
            _round_trip(tc, a.tensors, [6, 7, 8, 9], 30)
            _round_trip(tb, b.tensors, [10, 11, 12, 13], 40)
        finally:
            for t in (ta, tb, tc):
                if t is not None:
                    t.shutdown()
        assert not pinned.is_pinned(), "the pool stayed page-locked after every transfer shut down"
