"""``kvtier bench copy --device cuda``: KV blocks between a real GPU's KV
cache and host pool slots through DeviceTransfer (batched and per copy),
against torch's own ways of doing it (a gather through a staging buffer
plus one copy; a ``copy_`` per page) and against the ceiling: one large
contiguous copy of pinned memory each way, and both ways at once on two
streams, measured in the same run. Also what a host pool costs to create
and page-lock against torch's pinned allocation of the same size, and how
much a decode-like matmul loop slows while copies run ("do no harm"):
those two are in :mod:`kvtier.bench.device_cuda_costs`, the GPU's facts and
the table in :mod:`kvtier.bench.device_cuda_report`.

Layouts are vLLM's for a 32-layer model with 8 KV heads of 128 (bfloat16)
and for an MLA model (576 latent values per token): per-layer pages, K/V
split, one cross-layer tensor, MLA latent; blocks of 16 to 512 tokens. A run
moves about 1 GiB per direction between random blocks and random slots.

A command-line tool: runs in the ``kvtier`` process, which needs torch with
a CUDA GPU (else InvalidArgument, one line). Who calls:
:mod:`kvtier.bench.commands`. Blocks for the whole run: at most about
150 s at the defaults (a time budget trims the repeats of the last block
sizes when the first ran long), well under a minute with ``--quick``. Results:
one row per measurement: ceilings, copies (by block size, layout,
direction, contender), pool setup, do no harm.
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument

GIB = 1 << 30
LAYOUTS = ("per_layer", "kv_split", "cross_layer", "mla")
DIRECTIONS = ("h2d", "d2h", "both")
CONTENDERS = ("kvtier_batched", "kvtier_per_copy", "torch_gather", "torch_per_block")


@dataclass(frozen=True)
class Model:
    """The KV cache's model: vLLM's 32-layer GQA shape, and DeepSeek's MLA
    latent (512 + 64 values per token) for the MLA layout."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2  # bfloat16
    mla_dim: int = 576


@dataclass(frozen=True)
class Shape:
    """One layout at one block size: ``tensors`` KV tensors of shape
    ``(num_blocks, *inner)`` elements (kv_split: ``tensors // 2`` allocations
    of ``(2, num_blocks, *inner)``, each viewed as its K and V halves)."""

    layout: str
    tokens: int
    tensors: int
    inner: tuple[int, ...]
    page_bytes: int  # one tensor's bytes of one block

    @property
    def block_bytes(self) -> int:
        return self.tensors * self.page_bytes


def shape_of(layout: str, tokens: int, model: Model | None = None) -> Shape:
    """The KV tensors of ``layout`` at ``tokens`` per block. Pure."""
    m = model or Model()
    head = (m.kv_heads, m.head_dim)
    inner: tuple[int, ...]
    if layout == "per_layer":  # K and V of a block together, one tensor per layer
        inner, n = (2, tokens, *head), m.layers
    elif layout == "kv_split":  # vLLM's (2, num_blocks, ...) per layer
        inner, n = (tokens, *head), 2 * m.layers
    elif layout == "cross_layer":  # every layer's pages of a block in one page
        inner, n = (m.layers, 2, tokens, *head), 1
    elif layout == "mla":
        inner, n = (tokens, m.mla_dim), m.layers
    else:
        raise InvalidArgument(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    return Shape(layout, tokens, n, inner, int(np.prod(inner)) * m.dtype_bytes)


def blocks_per_run(block_bytes: int, bytes_per_run: int, host_budget: int) -> int:
    """Blocks each direction moves per run: about ``bytes_per_run``, at least
    one, with the pool (a slot for each stored and each loaded block) within
    ``host_budget`` bytes. Pure."""
    n = max(1, bytes_per_run // block_bytes)
    return max(1, min(n, host_budget // (2 * block_bytes)))


@dataclass(frozen=True)
class Settings:
    """What one run measures and how long it may take (see :func:`settings`)."""

    tokens: tuple[int, ...] = (16, 64, 256, 512)
    layouts: tuple[str, ...] = LAYOUTS
    repeats: int = 5
    bytes_per_run: int = GIB  # per direction
    # A job per this many bytes: about what one request's chunk of a long prompt is.
    job_bytes: int = 32 << 20
    # The per-page copy_ loop costs ~10 us of Python per page: capped per run.
    loop_copies: int = 8192
    pool_sizes: tuple[int, ...] = (GIB, 4 * GIB)
    pool_repeats: int = 2
    harm_seconds: float = 1.5  # each matmul window
    harm_rounds: int = 2
    # The whole run's seconds (make gpu-check kills the bench at 200): later
    # block sizes get fewer repeats, or none, when the earlier ones ran long.
    budget_s: float = 150.0
    model: Model = Model()


def settings(
    tokens: str | None = None,
    layouts: str | None = None,
    repeats: int | None = None,
    quick: bool = False,
) -> Settings:
    """The run's settings from the command line's text; ``quick``: a smoke
    run (64 MiB per run, two block sizes, short windows). Pure; raises
    InvalidArgument on bad input."""
    s = Settings()
    if quick:
        s = replace(
            s,
            tokens=(16, 256),
            repeats=2,
            bytes_per_run=64 << 20,
            loop_copies=512,
            pool_sizes=(256 << 20,),
            pool_repeats=1,
            harm_seconds=0.3,
            harm_rounds=1,
            budget_s=60.0,
        )
    if tokens:
        try:
            toks = tuple(int(x) for x in tokens.split(",") if x.strip())
        except ValueError:
            raise InvalidArgument(f"--tokens: comma-separated integers, got {tokens!r}") from None
        if not toks or not all(0 < t <= 4096 for t in toks):
            raise InvalidArgument(f"--tokens: each in [1, 4096], got {tokens!r}")
        s = replace(s, tokens=toks)
    if layouts:
        names = tuple(x.strip() for x in layouts.split(",") if x.strip())
        bad = [x for x in names if x not in LAYOUTS]
        if not names or bad:
            raise InvalidArgument(f"--layouts: from {', '.join(LAYOUTS)}, got {layouts!r}")
        s = replace(s, layouts=names)
    if repeats is not None:
        if repeats < 1:
            raise InvalidArgument(f"--repeats must be >= 1, got {repeats}")
        s = replace(s, repeats=repeats)
    return s


def require_cuda() -> Any:
    """torch, when it sees a CUDA GPU; else InvalidArgument saying why."""
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        raise InvalidArgument(
            "bench copy --device cuda needs torch with CUDA: torch is not installed"
        ) from None
    if not torch.cuda.is_available():
        raise InvalidArgument(
            f"bench copy --device cuda needs a CUDA GPU: torch {torch.__version__} sees none "
            "(torch.cuda.is_available() is False)"
        )
    return torch


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _timed(torch: Any, fn: Callable[[], None]) -> float:
    """Seconds from an idle GPU through ``fn`` until every stream is idle
    again (torch.cuda.synchronize waits for kvtier's streams too). Blocks."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def shm_free() -> int:
    """Free bytes of /dev/shm, where host pools live (containers often cap it)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class Staging:
    """Pinned host memory and GPU memory, ``2 * nbytes`` each, for the
    ceilings and torch's contenders: the first half for GPU->host, the
    second for host->GPU, so that both directions can run at once."""

    def __init__(self, torch: Any, nbytes: int) -> None:
        self.torch, self.n = torch, nbytes
        self.host = torch.empty(2 * nbytes, dtype=torch.uint8, pin_memory=True)
        self.gpu = torch.empty(2 * nbytes, dtype=torch.uint8, device="cuda")
        self.out_stream, self.in_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def both(self, d2h: Callable[[], None], h2d: Callable[[], None]) -> Callable[[], None]:
        """Both directions at once, each on a stream of its own."""

        def run() -> None:
            with self.torch.cuda.stream(self.out_stream):
                d2h()
            with self.torch.cuda.stream(self.in_stream):
                h2d()

        return run

    def ceiling(self, direction: str) -> tuple[Callable[[], None], int]:
        """One contiguous non_blocking copy of ``nbytes`` (each way for
        "both"): the fastest the link moves pinned memory. Returns the
        function and the bytes it moves."""
        n = self.n

        def d2h() -> None:
            self.host[:n].copy_(self.gpu[:n], non_blocking=True)

        def h2d() -> None:
            self.gpu[n:].copy_(self.host[n:], non_blocking=True)

        if direction == "both":
            return self.both(d2h, h2d), 2 * n
        return (d2h if direction == "d2h" else h2d), n


class Case:
    """One layout at one block size: its KV tensors on the GPU, kvtier's two
    DeviceTransfers over ``pool`` (a slot per stored and per loaded block),
    random blocks and slots, and each contender's run for each direction.
    Stores read ``out_blocks`` into ``out_slots``; loads write ``in_slots``
    into ``in_blocks`` (disjoint, so both directions can run at once)."""

    def __init__(
        self,
        torch: Any,
        shape: Shape,
        n: int,
        pool: Any,
        st: Staging,
        s: Settings,
        batched_only: bool = False,
    ) -> None:
        from kvtier.worker.transfer import DeviceTransfer

        self.torch, self.shape, self.n, self.st = torch, shape, n, st
        nb = 2 * n
        bf16 = torch.bfloat16
        self.tensors: list[Any] = []
        if shape.layout == "kv_split":
            for _ in range(shape.tensors // 2):
                kv = torch.empty((2, nb, *shape.inner), dtype=bf16, device="cuda")
                self.tensors += [kv[0], kv[1]]
        else:
            self.tensors = [
                torch.empty((nb, *shape.inner), dtype=bf16, device="cuda")
                for _ in range(shape.tensors)
            ]
        # Each tensor's pages as (num_blocks, page bytes): views, for copy_.
        self.flat = [x.view(torch.uint8).view(nb, shape.page_bytes) for x in self.tensors]
        rng = np.random.default_rng(shape.tokens * 31 + LAYOUTS.index(shape.layout))
        blocks, slots = rng.permutation(nb), rng.permutation(nb)
        self.out_blocks, self.in_blocks = blocks[:n], blocks[n:]
        self.out_slots, self.in_slots = slots[:n], slots[n:]
        self.idx_out = torch.as_tensor(self.out_blocks, device="cuda")
        self.idx_in = torch.as_tensor(self.in_blocks, device="cuda")
        budget = max(GIB, 4 * n * shape.block_bytes)  # never Busy within a run
        self.transfers = {
            name: DeviceTransfer(self.tensors, pool, use_batch=batch, budget_bytes=budget)
            for name, batch in (("kvtier_batched", True), ("kvtier_per_copy", False))
            if batch or not batched_only
        }
        self.per_job = max(1, s.job_bytes // shape.block_bytes)
        self.loop_blocks = min(n, max(1, s.loop_copies // shape.tensors))
        self._job = 0
        torch.cuda.synchronize()

    def close(self) -> None:
        for t in self.transfers.values():
            t.shutdown()
        self.transfers.clear()
        self.tensors, self.flat = [], []

    def stats(self) -> dict[str, Any]:
        t = self.transfers.get("kvtier_batched")
        return dict(t.stats()) if t is not None else {}

    def contender(self, name: str, direction: str) -> tuple[Callable[[], None], int]:
        """``name``'s run in ``direction`` and the bytes it moves."""
        moved = self.n * self.shape.block_bytes * (2 if direction == "both" else 1)
        if name.startswith("kvtier"):
            return self._kvtier(self.transfers[name], direction), moved
        if name == "torch_gather":
            d2h, h2d = self._gather()
        else:
            d2h, h2d = self._per_block()
            moved = moved * self.loop_blocks // self.n
        if direction == "both":
            return self.st.both(d2h, h2d), moved
        return (d2h if direction == "d2h" else h2d), moved

    def _kvtier(self, t: Any, direction: str) -> Callable[[], None]:
        jobs = []
        for i in range(0, self.n, self.per_job):
            j = slice(i, i + self.per_job)
            if direction in ("d2h", "both"):
                jobs.append((True, self.out_blocks[j], self.out_slots[j]))
            if direction in ("h2d", "both"):  # interleaved: both queues busy at once
                jobs.append((False, self.in_blocks[j], self.in_slots[j]))

        def run() -> None:
            ids = []
            for store, blocks, slots in jobs:
                self._job += 1
                ok = (
                    t.submit_store(self._job, blocks, slots)
                    if store
                    else t.submit_load(self._job, slots, blocks)
                )
                if not ok:
                    raise RuntimeError("DeviceTransfer refused a job: its budget is full")
                ids.append(self._job)
            t.wait(ids, 120)  # kvtier.Timeout rather than a hung benchmark
            bad = [r for r in t.get_finished() if not r.success]
            if bad:
                raise RuntimeError(f"a kvtier copy job failed: {bad[0].error}")

        return run

    def _gather(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """torch's gather: index_select of each tensor's blocks into a
        contiguous GPU buffer, then one copy to pinned memory (and back:
        one copy up, then index_copy_ into each tensor)."""
        torch, st, n, sh = self.torch, self.st, self.n, self.shape
        size = n * sh.block_bytes

        def staged(base: int) -> list[Any]:
            step = n * sh.page_bytes
            return [
                st.gpu[base + i * step : base + (i + 1) * step]
                .view(torch.bfloat16)
                .view(n, *sh.inner)
                for i in range(sh.tensors)
            ]

        out, into = staged(0), staged(st.n)

        def d2h() -> None:
            for x, o in zip(self.tensors, out):
                torch.index_select(x, 0, self.idx_out, out=o)
            st.host[:size].copy_(st.gpu[:size], non_blocking=True)

        def h2d() -> None:
            st.gpu[st.n : st.n + size].copy_(st.host[st.n : st.n + size], non_blocking=True)
            for x, i in zip(self.tensors, into):
                x.index_copy_(0, self.idx_in, i)

        return d2h, h2d

    def _per_block(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """torch's loop: ``host[slot].copy_(kv[block], non_blocking=True)``
        per block and tensor, into pinned slots laid out as kvtier's."""
        sh, m = self.shape, self.loop_blocks
        slots = self.st.host[: 2 * self.n * sh.block_bytes].view(2 * self.n, sh.block_bytes)
        host = [slots[:, i * sh.page_bytes : (i + 1) * sh.page_bytes] for i in range(sh.tensors)]
        pairs = list(zip(self.flat, host))
        out = list(zip(self.out_blocks[:m].tolist(), self.out_slots[:m].tolist()))
        into = list(zip(self.in_blocks[:m].tolist(), self.in_slots[:m].tolist()))

        def d2h() -> None:
            for b, s in out:
                for kv, h in pairs:
                    h[s].copy_(kv[b], non_blocking=True)

        def h2d() -> None:
            for b, s in into:
                for kv, h in pairs:
                    kv[b].copy_(h[s], non_blocking=True)

        return d2h, h2d


def ceilings(torch: Any, st: Staging, repeats: int) -> dict[str, list[float]]:
    """GB/s of each run of each direction's ceiling (after a warm-up). Blocks."""
    out: dict[str, list[float]] = {}
    for d in DIRECTIONS:
        fn, moved = st.ceiling(d)
        _timed(torch, fn)
        out[d] = [moved / _timed(torch, fn) / 1e9 for _ in range(repeats)]
    return out


def repeats_within(seconds_left: float, per_round_s: float, cases_left: int, repeats: int) -> int:
    """Rounds each of ``cases_left`` cases can afford in ``seconds_left`` at
    ``per_round_s`` a round (a case runs one more, its warm-up): ``repeats``
    when they fit, fewer when not, 0 when not even one round does. Pure."""
    if per_round_s <= 0 or cases_left <= 0:
        return repeats
    return max(0, min(repeats, int(seconds_left / (per_round_s * cases_left)) - 1))


def measure_case(torch: Any, case: Case, repeats: int) -> list[dict[str, Any]]:
    """Every contender in every direction: a warm-up each, then ``repeats``
    rounds running each contender once per round (drift hits all alike).
    The per-page loop, when capped, runs at most 3 rounds. Blocks."""
    rows = []
    sh = case.shape
    loop_rounds = repeats if case.loop_blocks == case.n else min(repeats, 3)
    for d in DIRECTIONS:
        fns = {c: case.contender(c, d) for c in CONTENDERS}
        runs: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        for fn, _ in fns.values():
            _timed(torch, fn)
        for r in range(repeats):
            for c, (fn, moved) in fns.items():
                if c != "torch_per_block" or r < loop_rounds:
                    runs[c].append(moved / _timed(torch, fn) / 1e9)
        gather = median(runs["torch_gather"])
        for c in CONTENDERS:
            gbps = median(runs[c])
            blocks = case.loop_blocks if c == "torch_per_block" else case.n
            rows.append(
                {
                    "measure": "copy",
                    "layout": sh.layout,
                    "tokens_per_block": sh.tokens,
                    "page_bytes": sh.page_bytes,
                    "tensors": sh.tensors,
                    "block_bytes": sh.block_bytes,
                    "direction": d,
                    "contender": c,
                    "gbps": round(gbps, 3),
                    "runs": [round(x, 3) for x in runs[c]],
                    "repeats": len(runs[c]),
                    "ratio_to_torch_gather": round(gbps / gather, 3),
                    "blocks_per_run": blocks,
                    "bytes_per_run": fns[c][1],
                    "copies_per_run": blocks * sh.tensors * (2 if d == "both" else 1),
                }
            )
    return rows
