"""DeviceTransfer's copies in order with torch's streams on a real GPU,
without any sync by the caller: a store copies what the compute stream
queued before it wrote (default stream, a side stream passed by handle, a
side stream current in torch); a load waits for kernels queued before it that
still read its blocks; a load of slots a pending store fills sees the stored
bytes (only the slots order them: each is on a stream of its own).

Each test queues ~0.15 s of GPU sleep first and checks that the stream was
still busy when submit returned: else the test proves nothing (or submit
blocked, which it must never do)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gpu import cuda_case as case

case.skip_without_gpu()

import torch  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402
from kvtier.worker.transfer import DeviceTransfer  # noqa: E402

NB = 48
PAGE = 64 * 1024


@pytest.fixture(autouse=True, scope="module")
def _real_runtime(request: pytest.FixtureRequest) -> None:
    case.require_own_process(request)


@pytest.fixture
def kv() -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(11)
    t = torch.randint(0, 256, (NB, PAGE), dtype=torch.uint8, device="cuda", generator=gen)
    torch.cuda.synchronize()
    return t


def _warm(t: DeviceTransfer) -> None:
    """One store and one load first, so that nothing lazy (events, streams)
    lands inside the measured submit; and one launch of each kernel the
    tests queue behind their sleep. CUDA loads a kernel at its first launch
    (lazy loading, its default), and that load waits for the work already on
    the GPU: on an H200 a first ``index_select`` behind the sleep held the
    host 159 ms, until the sleep ended, while kvtier's submit took 0.4 ms
    (gpu-check, 2026-12-04)."""
    assert t.submit_store(900, [0], [15])
    case.assert_ok(t, [900])
    assert t.submit_load(901, [15], [0])
    case.assert_ok(t, [901])
    scratch = torch.zeros(4, PAGE, dtype=torch.uint8, device="cuda")
    scratch[1].fill_(0x11)
    scratch.index_select(0, torch.tensor([0, 2, 3], device="cuda"))
    torch.cuda._sleep(1)
    torch.cuda.synchronize()


def _still_busy(stream: torch.cuda.Stream, what: str) -> None:
    assert not stream.query(), (
        f"{what}: the stream had drained when submit returned, so this run proves nothing "
        "(or the submit blocked until the compute work ended)"
    )


def test_a_store_copies_what_the_default_stream_wrote_after_the_submit(kv: torch.Tensor) -> None:
    with HostPool(16, PAGE) as pool:
        t = DeviceTransfer([kv], pool)
        try:
            _warm(t)
            pool.view(0)[:] = case.POISON_HOST
            torch.cuda._sleep(case.SLEEP_CYCLES)  # the forward pass, still running
            kv[5].fill_(0x77)  # ... then writing the block
            assert t.submit_store(1, [5], [0])  # no sync: torch's default stream is current
            busy = not torch.cuda.default_stream().query()
            case.assert_ok(t, [1])
            assert (pool.view(0) == 0x77).all(), "the store copied the block before it was written"
            assert busy, "the default stream had drained when submit returned: nothing was tested"
        finally:
            t.shutdown()


@pytest.mark.parametrize("how", ["stream_argument", "current_stream"])
def test_a_store_copies_what_a_side_stream_wrote(kv: torch.Tensor, how: str) -> None:
    side = torch.cuda.Stream()
    with HostPool(16, PAGE) as pool:
        t = DeviceTransfer([kv], pool)
        try:
            _warm(t)
            pool.view(0)[:] = case.POISON_HOST
            with torch.cuda.stream(side):
                torch.cuda._sleep(case.SLEEP_CYCLES)
                kv[5].fill_(0x42)
                if how == "current_stream":  # stream left None: torch's current one
                    assert t.submit_store(1, [5], [0])
            if how == "stream_argument":  # the current stream (default) is idle here
                assert t.submit_store(1, [5], [0], stream=side.cuda_stream)
            _still_busy(side, how)
            case.assert_ok(t, [1])
            assert (pool.view(0) == 0x42).all(), "the store did not wait for the side stream"
        finally:
            t.shutdown()


@pytest.mark.parametrize("where", ["default_stream", "side_stream"])
def test_a_load_waits_for_earlier_reads_of_its_blocks(kv: torch.Tensor, where: str) -> None:
    blocks = [3, 9, 20]
    idx = torch.tensor(blocks, device="cuda")  # on the GPU before the sleep: no host copy later
    old = kv[idx].cpu()
    stream = torch.cuda.default_stream() if where == "default_stream" else torch.cuda.Stream()
    with HostPool(16, PAGE) as pool:
        t = DeviceTransfer([kv], pool)
        try:
            _warm(t)
            for j in range(3):
                pool.view(j)[:] = 0x30 + j
            with torch.cuda.stream(stream):
                torch.cuda._sleep(case.SLEEP_CYCLES)
                seen = kv.index_select(0, idx)  # a kernel that will read the blocks
                assert t.submit_load(1, [0, 1, 2], blocks)  # stream None: the current one
            _still_busy(stream, where)
            case.assert_ok(t, [1])
            stream.synchronize()
            assert torch.equal(seen.cpu(), old), "the load overwrote blocks a kernel was to read"
            for j, b in enumerate(blocks):
                assert bool((kv[b] == 0x30 + j).all()), f"block {b} was not loaded"
        finally:
            t.shutdown()


@pytest.mark.parametrize("expedited", [False, True], ids=["load", "expedited_load"])
def test_a_load_of_slots_a_pending_store_fills_sees_the_stored_bytes(
    kv: torch.Tensor, expedited: bool
) -> None:
    src, dst, slots = [1, 4, 7, 10], [30, 33, 36, 39], [5, 2, 11, 8]
    want = kv[src].cpu()
    held, idle = torch.cuda.Stream(), torch.cuda.Stream()
    with HostPool(16, PAGE) as pool:
        pool.view(0, 16)[:] = case.POISON_HOST
        t = DeviceTransfer([kv], pool)
        try:
            _warm(t)
            with torch.cuda.stream(held):
                torch.cuda._sleep(case.SLEEP_CYCLES)  # holds the store back
            assert t.submit_store(1, src, slots, stream=held.cuda_stream)
            # Its own stream has nothing queued: only the slots order the load.
            assert t.submit_load(2, slots, dst, expedited=expedited, stream=idle.cuda_stream)
            _still_busy(held, "store")
            results = case.finish(t, [1, 2])
            assert all(r.success for r in results.values()), results
            got = kv[dst].cpu()
            assert not bool((got == case.POISON_HOST).all(dim=1).any()), "loaded unfilled slots"
            assert torch.equal(got, want), "the load did not see the stored bytes"
        finally:
            t.shutdown()


def test_jobs_of_one_direction_end_in_submission_order(kv: torch.Tensor) -> None:
    # The engine reports a direction's jobs in stream order; a real GPU may
    # finish small copies early, never out of their stream's order.
    with HostPool(16, PAGE) as pool:
        t = DeviceTransfer([kv], pool)
        try:
            _warm(t)
            rng = np.random.default_rng(5)
            ids = list(range(1, 13))
            for j in ids:
                n = int(rng.integers(1, 8))
                assert t.submit_store(j, rng.permutation(NB)[:n], rng.permutation(16)[:n])
            order: list[int] = []
            t.wait(ids, 30)
            for _ in range(1000):
                for r in t.get_finished():
                    assert r.success, r.error
                    order.append(r.job_id)
                if len(order) >= len(ids):
                    break
                time.sleep(0.001)
            assert order == ids
        finally:
            t.shutdown()
