"""DeviceTransfer: every KV layout, both backends (CPU threads; CUDA on the fake runtime)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import kvtier
import numpy as np
import pytest
import torch
from kvtier.pool import HostPool
from kvtier.transfer import DeviceTransfer

NB = 64  # KV blocks


@pytest.fixture(params=["cpu", "cuda"])
def backend(request: pytest.FixtureRequest, fake_cudart) -> str:  # type: ignore[no-untyped-def]
    fake_cudart.fake_cuda_set_delay_us(0)
    fake_cudart.fake_cuda_fail_copies(0, 0)
    fake_cudart.fake_cuda_fail_queries(0, 0)
    return str(request.param)


def finish(t: DeviceTransfer, ids: list[int]) -> dict[int, object]:
    t.wait(ids)
    got: dict[int, object] = {}
    deadline = time.monotonic() + 10
    while len(got) < len(ids) and time.monotonic() < deadline:
        for r in t.get_finished():
            got[r.job_id] = r
        time.sleep(0.001)
    assert set(got) == set(ids)
    return got


def layouts() -> dict[str, tuple[list[torch.Tensor], list[int] | None]]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    shared = rnd(NB, 3, 2048)
    mla_pages = [1152 * 4, 1152 * 4, 512]
    return {
        "per_layer": ([rnd(NB, 4096) for _ in range(4)], None),
        "layers_share_one_tensor": ([shared[:, i, :] for i in range(3)], None),
        "packed_cross_layer": ([rnd(NB, 8 * 1024)], None),
        "mla_and_mixed_pages": ([rnd(NB, p) for p in mla_pages], None),
        "padded_pages": ([rnd(NB, 4096)], [4000]),
    }


@pytest.mark.parametrize("layout", list(layouts()))
@pytest.mark.parametrize("bpc", [1, 4])
def test_round_trip_every_layout(backend: str, layout: str, bpc: int, fake_cudart) -> None:  # type: ignore[no-untyped-def]
    tensors, pages = layouts()[layout]
    page_total = sum(pages or [t[0].numel() for t in tensors])
    with HostPool(64, -(-page_total * bpc // 64) * 64) as pool:
        fake_cudart.on_gpu(*tensors)
        t = DeviceTransfer(tensors, pool, blocks_per_chunk=bpc, page_bytes=pages, backend=backend)
        rng = np.random.default_rng(1)
        blocks = rng.permutation(NB)[:10]
        first = 2 if bpc > 1 else 0  # first chunk partly covered
        nchunks = -(-(first % bpc + len(blocks)) // bpc)
        slots = rng.permutation(64)[:nchunks]
        before = [x[blocks].clone() for x in tensors]
        assert t.submit_store(1, blocks, slots, first_block_index=first)
        finish(t, [1])
        for x in tensors:
            x.zero_()
        dst = rng.permutation(NB)[:10]
        assert t.submit_load(2, slots, dst, first_block_index=first)
        res = finish(t, [2])
        assert res[2].success  # type: ignore[attr-defined]
        for x, b, p in zip(tensors, before, pages or [None] * len(tensors)):
            n = p or x[0].numel()
            assert torch.equal(x[dst].reshape(len(dst), -1)[:, :n], b.reshape(len(dst), -1)[:, :n])
        t.shutdown()


def test_descriptor_shapes_and_errors() -> None:
    kv = [torch.zeros(NB, 4096, dtype=torch.uint8)]
    with HostPool(8, 8192) as pool:
        t = DeviceTransfer(kv, pool, blocks_per_chunk=2)
        d = t.descriptors([0, 1, 2], [0, 1], first_block_index=1)
        assert d.shape == (3, 3)
        # block 0 goes to the 2nd position of chunk 0, blocks 1-2 fill chunk 1
        assert d[0, 1] == pool.slot_address(0) + 4096
        assert d[1, 1] == pool.slot_address(1) and d[2, 1] == pool.slot_address(1) + 4096
        with pytest.raises(kvtier.InvalidArgument, match="span 2 chunk"):
            t.descriptors([0, 1, 2], [0], first_block_index=1)
        with pytest.raises(kvtier.InvalidArgument, match="block id out of range"):
            t.descriptors([NB], [0])
        with pytest.raises(kvtier.InvalidArgument, match="slot out of range"):
            t.descriptors([0], [8])
        t.shutdown()
        with pytest.raises(kvtier.InvalidArgument, match="a chunk needs"):
            DeviceTransfer(kv, pool, blocks_per_chunk=4)


def test_descriptor_table_of_a_whole_cache_matches_a_per_block_reference() -> None:
    # Speed is the bench's business; here the vectorised table must say what
    # a per-block loop would: each block of each layer to its place in its slot.
    kv = [torch.zeros(4096, 256, dtype=torch.uint8) for _ in range(8)]
    with HostPool(4096, 2048) as pool:
        t = DeviceTransfer(kv, pool)
        rng = np.random.default_rng(3)
        blocks, slots = rng.permutation(4096), rng.permutation(4096)
        got = {tuple(int(v) for v in row) for row in t.descriptors(blocks, slots)}
        want = {
            (x.data_ptr() + int(b) * 256, pool.slot_address(int(s)) + i * 256, 256)
            for b, s in zip(blocks, slots)
            for i, x in enumerate(kv)
        }
        assert got == want
        back = {tuple(int(v) for v in row) for row in t.descriptors(blocks, slots, to_host=False)}
        assert back == {(d, s, n) for s, d, n in want}
        t.shutdown()


def test_replicated_layout_non_writer_acks_without_copying() -> None:
    kv = [torch.ones(NB, 1024, dtype=torch.uint8)]
    with HostPool(4, 1024) as pool:
        t = DeviceTransfer(kv, pool, is_writer=False)
        assert t.submit_store(7, [0], [0])
        (r,) = t.get_finished()
        assert (r.job_id, r.success, r.transfer_size) == (7, True, 0)
        assert int(pool.view(0).sum()) == 0
        t.shutdown()


def test_load_after_store_of_same_slot_sees_stored_bytes(backend: str, fake_cudart) -> None:  # type: ignore[no-untyped-def]
    kv = [torch.randint(0, 256, (NB, 65536), dtype=torch.uint8)]
    with HostPool(4, 65536) as pool:
        fake_cudart.on_gpu(*kv)
        t = DeviceTransfer(kv, pool, backend=backend)
        fake_cudart.fake_cuda_set_store_delay_us(50_000)  # stores crawl on the fake GPU
        want = kv[0][3].clone()
        assert t.submit_store(1, [3], [2])
        assert t.submit_load(2, [2], [9])
        if backend == "cpu":  # the load was queued behind the store (serial queue)
            assert t._slot_job[2][1] == 0
        t.wait([2])
        assert torch.equal(kv[0][9], want)  # final right after wait, before get_finished
        fake_cudart.fake_cuda_set_store_delay_us(0)
        finish(t, [1, 2])
        t.shutdown()


def test_transfers_in_one_direction_complete_in_order(backend: str, fake_cudart) -> None:  # type: ignore[no-untyped-def]
    kv = [torch.randint(0, 256, (NB, 4096), dtype=torch.uint8)]
    with HostPool(64, 4096) as pool:
        fake_cudart.on_gpu(*kv)
        t = DeviceTransfer(kv, pool, backend=backend)
        fake_cudart.fake_cuda_set_delay_us(2000)
        for j in range(20):
            assert t.submit_store(j, [j], [j])
        order: list[int] = []
        while len(order) < 20:
            order += [r.job_id for r in t.get_finished()]
            time.sleep(0.001)
        assert order == list(range(20))
        fake_cudart.fake_cuda_set_delay_us(0)
        t.shutdown()


def test_store_waits_for_the_compute_stream(fake_cudart) -> None:  # type: ignore[no-untyped-def]
    fake_cudart.fake_cuda_set_delay_us(0)
    kv = [torch.zeros(NB, 4096, dtype=torch.uint8)]
    stream = ctypes.c_void_p()
    assert fake_cudart.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
    with HostPool(4, 4096) as pool:
        fake_cudart.on_gpu(*kv)
        t = DeviceTransfer(kv, pool, backend="cuda")
        # "compute" still running: 50 ms, then it writes block 5
        fake_cudart.fake_cuda_stream_sleep_us(stream, 50_000)
        fake_cudart.fake_cuda_stream_fill(stream, kv[0][5].data_ptr(), 0x77, 4096)
        assert t.submit_store(1, [5], [0], stream=stream.value)
        res = finish(t, [1])
        assert res[1].success  # type: ignore[attr-defined]
        assert (pool.view(0) == 0x77).all()
        t.shutdown()
    fake_cudart.cudaStreamDestroy(stream)


def test_cuda_errors_fail_the_job_with_the_runtime_message(fake_cudart) -> None:  # type: ignore[no-untyped-def]
    # Invalid argument is not sticky: the next job works. (A sticky error ends
    # every later job: tests/unit/test_cuda_semantics.py, in a child process.)
    kv = [torch.zeros(NB, 4096, dtype=torch.uint8)]
    with HostPool(4, 4096) as pool:
        fake_cudart.on_gpu(*kv)
        t = DeviceTransfer(kv, pool, backend="cuda")
        fake_cudart.fake_cuda_fail_copies(1, 1)
        assert t.submit_store(1, [0, 1], [0, 1])
        res = finish(t, [1])[1]
        assert not res.success and "invalid argument" in res.error  # type: ignore[attr-defined]
        assert t.submit_load(3, [0], [3])  # later jobs work again
        assert finish(t, [3])[3].success  # type: ignore[attr-defined]
        t.shutdown()


def test_a_timed_out_store_fails_but_keeps_its_slot_until_the_copy_ends(fake_cudart) -> None:  # type: ignore[no-untyped-def]
    kv = [torch.randint(0, 256, (NB, 4096), dtype=torch.uint8)]
    with HostPool(4, 4096) as pool:
        fake_cudart.on_gpu(*kv)
        t = DeviceTransfer(kv, pool, backend="cuda", deadline_s=0.05)
        fake_cudart.fake_cuda_set_store_delay_us(500_000)
        assert t.submit_store(1, [3], [2])
        res = finish(t, [1])[1]
        assert not res.success and res.error.startswith("timed out")  # type: ignore[attr-defined]
        fake_cudart.fake_cuda_set_store_delay_us(0)
        # The store is still on the GPU: a load of its slot is queued behind it
        # (and may time out itself while it waits there).
        assert t.submit_load(2, [2], [9])
        finish(t, [2])
        until = time.monotonic() + 10
        while t._slot_job and time.monotonic() < until:
            assert t.get_finished() == []  # late ends are not reported again
            time.sleep(0.01)
        assert t._slot_job == {}
        assert torch.equal(kv[0][9], kv[0][3])
        t.shutdown()


def test_pool_is_registered_with_cuda_and_released(fake_cudart) -> None:  # type: ignore[no-untyped-def]
    kv = [torch.zeros(NB, 4096, dtype=torch.uint8)]
    base = fake_cudart.fake_cuda_registered_bytes()
    with HostPool(16, 4096) as pool:
        fake_cudart.on_gpu(*kv)
        t = DeviceTransfer(kv, pool, backend="cuda")
        assert fake_cudart.fake_cuda_registered_bytes() - base == pool.nbytes
        s = t.stats()
        assert s["runtime"] == fake_cudart.fake_path and s["runtime_version"] == 13000
        batches = fake_cudart.fake_cuda_batch_calls()
        t.submit_store(1, [0, 1, 2], [0, 1, 2])
        finish(t, [1])
        assert fake_cudart.fake_cuda_batch_calls() == batches + 1  # CUDA >= 12.8: one batch call
        t.shutdown()
        del t
    import gc

    gc.collect()
    assert fake_cudart.fake_cuda_registered_bytes() == base


def test_per_copy_path_and_cuda_12_8_batch_signature(fake_cudart) -> None:  # type: ignore[no-untyped-def]
    kv = [torch.randint(0, 256, (NB, 4096), dtype=torch.uint8)]
    with HostPool(8, 4096) as pool:
        fake_cudart.on_gpu(*kv)
        t = DeviceTransfer(kv, pool, backend="cuda", use_batch=False)
        calls = fake_cudart.fake_cuda_memcpy_calls()
        t.submit_store(1, [0, 1, 2], [0, 1, 2])
        finish(t, [1])
        assert fake_cudart.fake_cuda_memcpy_calls() == calls + 3
        assert torch.equal(torch.from_numpy(pool.view(0, 3)), kv[0][:3])
        t.shutdown()
    # The 12.8 signature (with failIdx) runs in a process that sees version 12080.
    code = (
        "import torch, numpy as np\n"
        "from kvtier.pool import HostPool\nfrom kvtier.transfer import DeviceTransfer\n"
        "kv=[torch.randint(0,256,(8,4096),dtype=torch.uint8)]\n"
        "import ctypes, os; f=ctypes.CDLL(os.environ['KVTIER_CUDART'])\n"
        "f.fake_cuda_declare_device.argtypes=[ctypes.c_void_p,ctypes.c_size_t,ctypes.c_int]\n"
        "f.fake_cuda_declare_device(kv[0].data_ptr(),kv[0].nbytes,0)\n"
        "p=HostPool(8,4096); t=DeviceTransfer(kv,p,backend='cuda')\n"
        "t.submit_store(1,[0,1,2],[0,1,2]); t.wait([1])\n"
        "assert t.stats()['runtime_version']==12080 and t.stats()['batch_calls']==1\n"
        "assert np.array_equal(p.view(0,3), kv[0][:3].numpy()); print('ok')\n"
    )
    env = {**os.environ, "FAKE_CUDA_VERSION": "12080", "KVTIER_CUDART": fake_cudart.fake_path}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_imports_and_cpu_backend_work_without_libcudart() -> None:
    code = (
        "import kvtier, torch\nfrom kvtier import _native\n"
        "from kvtier.pool import HostPool\nfrom kvtier.transfer import DeviceTransfer\n"
        "try:\n    _native.cuda_runtime(); print('loaded')\n"
        "except kvtier.CudaError as e:\n    print('no cuda:', 'KVTIER_CUDART' in str(e))\n"
        "kv=[torch.ones(4,4096,dtype=torch.uint8)]\np=HostPool(4,4096)\n"
        "t=DeviceTransfer(kv,p); t.submit_store(1,[2],[3]); t.wait([1])\n"
        "print(int(p.view(3).sum()))\n"
    )
    env = {**os.environ, "KVTIER_CUDART": "/nonexistent/libcudart.so"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split("\n")[:2] == ["no cuda: True", "4096"], out.stderr


@pytest.mark.parametrize("layout", list(layouts()))
def test_numpy_arrays_describe_like_the_torch_tensors_over_them(layout: str) -> None:
    """numpy stands in for the GPU cache where torch is missing: a numpy view of
    each tensor's memory gives the same addresses, pages and strides."""
    from kvtier.transfer import layout_from_tensors

    tensors, pages = layouts()[layout]
    arrays = [t.numpy() for t in tensors]
    want, got = layout_from_tensors(tensors, pages), layout_from_tensors(arrays, pages)
    for f in ("bases", "page_bytes", "strides", "chunk_offsets"):
        assert getattr(got, f).tolist() == getattr(want, f).tolist(), f
    assert got.num_blocks == want.num_blocks == NB


def test_numpy_round_trip_bytes() -> None:
    kv = np.random.default_rng(1).integers(0, 256, (NB, 2, 4096), dtype=np.uint8)
    ref = kv.copy()
    with HostPool(NB, 8192) as pool:
        t = DeviceTransfer([kv[:, 0, :], kv[:, 1, :]], pool)
        assert t.submit_store(1, [3, 9], [0, 1])
        finish(t, [1])
        kv[[3, 9]] = 0
        assert t.submit_load(2, [0, 1], [20, 21])
        finish(t, [2])
        assert kv[[20, 21]].tobytes() == ref[[3, 9]].tobytes()
        t.shutdown()


def test_read_only_numpy_array_is_refused(pool: HostPool) -> None:
    kv = np.zeros((NB, 4096), np.uint8)
    kv.flags.writeable = False
    with pytest.raises(kvtier.InvalidArgument, match="a numpy KV array must be writeable"):
        DeviceTransfer([kv], pool)


def test_a_fenced_load_copies_each_slot_once_its_write_settles(backend: str, fake_cudart) -> None:  # type: ignore[no-untyped-def]
    """A load from slots a lower tier still fills (the manager's fenced
    read-ahead): nothing of a slot is copied before its write settles, the
    slots already filled go first (CPU copies run slot by slot; CUDA copies
    are enqueued once all are filled), and a write that failed fails the
    job without copying its slot."""
    kv = [torch.zeros((NB, 4096), dtype=torch.uint8) for _ in range(2)]
    with HostPool(8, 8192) as pool:
        fake_cudart.on_gpu(*kv)
        t = DeviceTransfer(kv, pool, backend=backend)
        for s in range(4):
            pool.view(s)[:] = s + 1
        armed = pool.arm_fences([0, 1, 2])
        assert [pool.fence_word(s) for s in range(3)] == armed.tolist()
        fences = armed.copy()
        fences[0] = 0  # slot 0: already filled, no wait
        assert t.submit_load(1, [0, 1, 2], [5, 6, 7], fences=fences)
        if backend == "cpu":  # slot 0 is copied while slot 1 is still being filled
            deadline = time.monotonic() + 10
            while int(kv[1][5].min()) != 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert int(kv[1][5].min()) == 1
        time.sleep(0.05)
        assert t.get_finished() == []
        assert int(kv[0][6].max()) == 0 and int(kv[0][7].max()) == 0
        assert pool.settle_fence(1, int(armed[1]), True)
        assert not pool.settle_fence(1, int(armed[1]), False)  # settled once
        time.sleep(0.05)
        assert t.get_finished() == [] and int(kv[0][7].max()) == 0
        assert pool.settle_fence(2, int(armed[2]), True)
        (r,) = finish(t, [1]).values()
        assert r.success, r.error  # type: ignore[attr-defined]
        for j in range(3):
            for tensor in kv:
                assert int(tensor[5 + j].min()) == int(tensor[5 + j].max()) == j + 1
        a = pool.arm_fences([3])
        assert t.submit_load(2, [3], [9], fences=a)
        assert pool.settle_fence(3, int(a[0]), False)
        (r,) = finish(t, [2]).values()
        assert not r.success and "never came" in r.error  # type: ignore[attr-defined]
        assert int(kv[0][9].max()) == 0 and int(kv[1][9].max()) == 0
        with pytest.raises(kvtier.InvalidArgument, match="2 slots"):
            t.submit_load(3, [0, 1], [1, 2], fences=[int(a[0])])
        with pytest.raises(kvtier.InvalidArgument, match="not an armed fence"):
            t.submit_load(4, [0], [1], fences=[4])  # a settled word
        t.shutdown()


@pytest.mark.timeout(20)  # before the bound, wait() blocked for as long as the job ran
def test_a_wait_without_a_timeout_names_the_job_that_never_ends(backend: str, fake_cudart) -> None:  # type: ignore[no-untyped-def]
    """A job that never ends (a fenced load whose write nobody settles: it
    would run until the fence's own 30 s) does not hang wait(): past the
    transfer's bound, kvtier.Timeout names that job, not the one that
    ended; it stays in flight and is reported once it does end."""
    kv = [torch.zeros((NB, 4096), dtype=torch.uint8)]
    with HostPool(8, 4096) as pool:
        fake_cudart.on_gpu(*kv)
        t = DeviceTransfer(kv, pool, backend=backend)
        t.wait_timeout_s = 0.25
        pool.view(3)[:] = 7
        armed = pool.arm_fences([3])
        assert t.submit_load(7, [3], [5], fences=armed)
        assert t.submit_store(8, [1], [2])
        t0 = time.monotonic()
        with pytest.raises(kvtier.Timeout) as e:
            t.wait([8, 7])
        assert 0.25 <= time.monotonic() - t0 < 10
        assert str(e.value) == (
            "DeviceTransfer: load job 7 (host slots 3) not finished within 0.25 s "
            "(still in flight: get_finished reports each when it ends)"
        )
        assert [r.job_id for r in t.get_finished()] == [8]
        with pytest.raises(kvtier.Timeout, match=r"^DeviceTransfer: load job 7 .* within 0\.01 s"):
            t.wait([7], timeout=0.01)  # a timeout given is kept too
        assert int(kv[0][5].max()) == 0
        assert pool.settle_fence(3, int(armed[0]), True)
        t.wait_timeout_s = 0  # no bound
        (r,) = finish(t, [7]).values()
        assert r.success and int(kv[0][5].min()) == 7  # type: ignore[attr-defined]
        t.shutdown()


def test_the_wait_bound_defaults_to_the_vllm_options_and_is_checked(pool: HostPool) -> None:
    from kvtier.options import VllmOptions
    from kvtier.worker import WAIT_TIMEOUT_S

    kv = np.zeros((4, 4096), np.uint8)
    assert WAIT_TIMEOUT_S == VllmOptions().transfer_wait_s == 120.0
    t = DeviceTransfer([kv], pool)
    assert t.wait_timeout_s == WAIT_TIMEOUT_S
    t.shutdown()
    t = DeviceTransfer([kv], pool, wait_timeout_s=3)
    assert t.wait_timeout_s == 3.0
    t.shutdown()
    for bad in (-1.0, float("nan")):
        with pytest.raises(kvtier.InvalidArgument, match="wait_timeout_s must be >= 0"):
            DeviceTransfer([kv], pool, wait_timeout_s=bad)
        with pytest.raises(kvtier.InvalidArgument, match="transfer_wait_s must be >= 0"):
            VllmOptions(transfer_wait_s=bad)


def test_cpu_transfers_populate_an_attached_pool_not_their_own() -> None:
    """A CPU worker's transfers enter the pages of a pool it attached to (a
    node's) in its page tables in the background, as CUDA's registration
    does, so its first copies fault no page; a pool it created was
    pre-faulted already and is left alone."""
    import resource

    with HostPool(32, 64 * 1024) as created:
        attached = HostPool.attach(created.name)  # another mapping of the same pages
        kv = torch.zeros((4, 1024), dtype=torch.uint8)
        own = DeviceTransfer([kv], created)
        theirs = DeviceTransfer([kv], attached)
        try:
            assert own._b.populating is None  # type: ignore[union-attr]
            theirs._b.populating.join(30)  # type: ignore[union-attr]
            data = attached.view(0, 32)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            data[:, ::4096] = data[:, ::4096].copy()  # a byte a page, as a store writes
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            assert faults < 32 * 64 * 1024 // 4096 // 64  # untouched: one a 16 pages
        finally:
            own.shutdown()
            theirs.shutdown()
            attached.close()
