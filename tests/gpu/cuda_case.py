"""What the real-CUDA tests (tests/gpu) share: the skips, the KV layouts the
vLLM and SGLang integrations hand DeviceTransfer, and byte-for-byte checks.

Who calls: the test modules beside it (``from gpu import cuda_case as case``,
as tests/integration does; a conftest.py here would shadow tests/conftest.py
for every ``from conftest import ...``). Nothing here blocks but
:func:`finish`, which waits for jobs.

The CUDA runtime is loaded once per process and the fake runtime's tests
(tests/unit) point kvtier at a fake: whichever loads first serves both. So
these tests skip in a session that also runs the fake's tests; run them on
their own: ``pytest tests/gpu``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

POISON_HOST = 0x5A  # host slots before a store: a byte not copied shows as this
POISON_KV = 0xA5  # KV blocks before a load, padding included
# torch.cuda._sleep cycles: about 0.15 s at an H100's clocks, far longer than a
# submit takes, so work queued before the submit is still running after it.
SLEEP_CYCLES = 300_000_000

# The layouts DeviceTransfer gets from the integrations, small (a few MiB).
LAYOUTS = (
    "per_layer",  # one tensor per layer, K and V of a block together
    "kv_split",  # vLLM's (2, num_blocks, ...) per layer: its K and V views
    "cross_layer",  # one tensor, every layer's pages of a block together
    "layers_share_one_tensor",  # views of one allocation, layers interleaved per block
    "mla_latent",  # one small page per layer (576 bf16 per token)
    "padded_pages",  # page_bytes < row (vLLM pads attention pages to the Mamba page)
    "mixed_pages",  # MLA latent beside an indexer cache (132 bytes per token)
)


def skip_without_gpu() -> None:
    """Skip the calling test module (at import) when there is no real runtime to test."""
    if os.environ.get("KVTIER_CUDART"):
        pytest.skip(
            "KVTIER_CUDART is set (it points kvtier at the fake runtime); tests/gpu need the real "
            "one: unset it",
            allow_module_level=True,
        )
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed", allow_module_level=True)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: torch.cuda.is_available() is False", allow_module_level=True)


def require_own_process(request: pytest.FixtureRequest) -> None:
    """Skip when this pytest session loads the fake runtime too (see the module docstring)."""
    if os.environ.get("KVTIER_CUDART"):
        pytest.skip("KVTIER_CUDART was set during this session (the fake runtime's tests ran)")
    for item in request.session.items:
        if "fake_cudart" in getattr(item, "fixturenames", ()):
            pytest.skip(
                f"this session also runs the fake CUDA runtime's tests ({item.nodeid}, ...) and a "
                "process loads one runtime: run `pytest tests/gpu` on its own"
            )


@dataclass
class Layout:
    tensors: list[Any]  # torch CUDA tensors, block-major
    page_bytes: list[int]  # copied bytes per block, per tensor
    padded: bool  # page_bytes must be passed to DeviceTransfer

    @property
    def page_arg(self) -> list[int] | None:
        return self.page_bytes if self.padded else None


def _random(gen: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """Random bytes of ``shape`` in ``dtype`` (bf16 from bytes: any bit pattern)."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8,
                        device=gen.device, generator=gen)  # fmt: skip
    return raw.view(dtype)


def make_layout(name: str, nb: int, seed: int = 0, device: str = "cuda") -> Layout:
    """Layout ``name`` over ``nb`` blocks of 16 tokens, random bytes (small
    head counts keep it to a few MiB; the shapes are the integrations').
    ``device`` "cpu" only to check these helpers without a GPU."""
    import torch

    bf16 = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    heads, dim, layers = 2, 64, 4

    def rnd(*shape: int, dtype: Any = bf16) -> Any:
        return _random(gen, shape, dtype)

    if name == "per_layer":
        ts = [rnd(nb, 2, 16, heads, dim) for _ in range(layers)]
    elif name == "kv_split":
        ts = []
        for _ in range(3):
            kv = rnd(2, nb, 16, heads, dim)
            ts += [kv[0], kv[1]]
    elif name == "cross_layer":
        ts = [rnd(nb, layers, 2, 16, heads, dim)]
    elif name == "layers_share_one_tensor":
        shared = rnd(nb, 3, 2, 16, heads, dim)
        ts = [shared[:, i] for i in range(3)]
    elif name == "mla_latent":
        ts = [rnd(nb, 16, 576) for _ in range(layers)]
    elif name == "padded_pages":
        ts = [rnd(nb, 16384, dtype=torch.uint8) for _ in range(2)]
        return Layout(ts, [12288, 12288], True)
    elif name == "mixed_pages":
        ts = [rnd(nb, 16, 576), rnd(nb, 16, 576), rnd(nb, 16 * 132, dtype=torch.uint8)]
    else:
        raise ValueError(name)
    return Layout(ts, [row_bytes(t) for t in ts], False)


def row_bytes(t: Any) -> int:
    return int(t[0].numel() * t.element_size())


def rows(t: Any) -> Any:
    """``t``'s bytes as ``(num_blocks, row bytes)`` uint8, a view (writes go
    through): a copy here would make every poisoning silently vanish."""
    import torch

    r = t.view(torch.uint8).flatten(1)
    assert r.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), "rows() copied"
    return r


def snapshot(t: Any) -> np.ndarray:
    """``t``'s bytes now, ``(num_blocks, row bytes)``, a copy on the host."""
    return np.array(rows(t).cpu().numpy(), copy=True)  # .cpu() of a CPU tensor is itself


def poison_blocks(tensors: list[Any], blocks: np.ndarray) -> None:
    """Fill whole rows (padding too) of ``blocks`` with :data:`POISON_KV`."""
    import torch

    for t in tensors:
        rows(t)[torch.as_tensor(blocks, device=t.device)] = POISON_KV


def expected_slots(
    before: list[np.ndarray],
    pages: list[int],
    blocks: np.ndarray,
    slots: np.ndarray,
    bpc: int,
    first: int,
    shape: tuple[int, int],
) -> np.ndarray:
    """The pool's slots after a store into poisoned slots, from the slot
    layout as documented (not from DeviceTransfer's own arithmetic): each
    tensor's pages for the chunk's blocks back to back, tensors in order."""
    want = np.full(shape, POISON_HOST, np.uint8)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(pages) * bpc)[:-1]])
    for j, b in enumerate(blocks.tolist()):
        pos = j + first % bpc
        s = int(slots[pos // bpc])
        for i, page in enumerate(pages):
            o = int(offsets[i]) + (pos % bpc) * page
            want[s, o : o + page] = before[i][b, :page]
    return want


def assert_bytes_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Byte-for-byte, naming the first differing place (not a 1 MiB array dump)."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    if bad.size:
        where = np.unravel_index(int(bad[0]), got.shape)
        raise AssertionError(
            f"{what}: {bad.size} bytes differ, first at {tuple(int(x) for x in where)}: "
            f"got {int(got[where]):#04x}, want {int(want[where]):#04x}"
        )


def finish(t: Any, ids: list[int], timeout: float = 30.0) -> dict[int, Any]:
    """Wait for ``ids`` (bytes final on return) and collect their results."""
    t.wait(ids, timeout)
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while set(ids) - set(got) and time.monotonic() < deadline:
        for r in t.get_finished():
            got[r.job_id] = r
        time.sleep(0.001)
    assert set(ids) <= set(got), f"results missing for jobs {sorted(set(ids) - set(got))}"
    return got


def assert_ok(t: Any, ids: list[int]) -> None:
    """Wait for ``ids`` and assert each succeeded."""
    for r in finish(t, ids).values():
        assert r.success, f"job {r.job_id} failed: {r.error}"


def shm_free_bytes() -> int:
    """Free bytes of /dev/shm, where host pools live (containers often cap it)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
