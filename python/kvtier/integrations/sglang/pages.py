"""SGLang HiCache shim: where a page's bytes lie in one of SGLang's host pools.

A page of SGLang's host KV pool is not one contiguous range in every
layout: ``page_first`` keeps a page's K and its V apart (two ranges, MLA
one), ``layer_first`` one range per layer and K/V. The plan reads it from the
pool's own :meth:`get_data_page` view (its shape and strides), so kvtier's
record of a page is exactly the bytes of SGLang's flat data page
(``get_data_page(index, flat=True)``), in that order, whatever the layout:
a page stored through the zero-copy interface reads back through the
key-value one and the other way round.

Who calls: :class:`kvtier.integrations.sglang.mover.PageMover` once per host
pool when SGLang registers it; then per batch, :meth:`PagePlan.addresses`
(vectorised, nothing blocks). Imports torch only through the pool's tensors.

Runs in each SGLang scheduler process (one per TP/PP rank).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument, UnsupportedEngine


def _runs(
    shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
) -> tuple[np.ndarray, int]:
    """Byte offsets (from the view's first element) of the contiguous runs of
    a strided view in C order, and the bytes of one run."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    run, k = 1, len(dims)
    while k and dims[k - 1][1] == run:
        run *= dims[k - 1][0]
        k -= 1
    offs = np.zeros(1, np.int64)
    for n, s in dims[:k]:
        offs = (offs[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    return offs * itemsize, run * itemsize


class PagePlan:
    """One host pool's page geometry: ``runs`` byte offsets per page (from the
    page's base address) of ``run_bytes`` each, ``page_bytes`` in all; the
    base of the page starting at token index ``t`` is ``first + (t //
    page_tokens) * page_stride``.

    ``pool`` is one of SGLang's ``HostKVCache`` objects (or anything with its
    ``kv_buffer``, ``page_size``, ``layout``, ``dtype`` and
    ``get_data_page``): its buffer must be one CPU tensor. Raises
    :class:`~kvtier.errors.UnsupportedEngine` for a pool it cannot map
    (a list of buffers, a device tensor, pages not evenly spaced).
    """

    def __init__(self, pool: Any) -> None:
        buf = getattr(pool, "kv_buffer", None)
        if buf is None or isinstance(buf, (list, tuple)) or not hasattr(buf, "data_ptr"):
            raise UnsupportedEngine(
                f"kvtier: SGLang host pool {type(pool).__name__} keeps no single KV tensor"
            )
        if str(buf.device) != "cpu" or not buf.is_contiguous():
            raise UnsupportedEngine(
                "kvtier: SGLang's host KV buffer must be a contiguous CPU tensor"
            )
        self.buffer = buf
        self.base = int(buf.data_ptr())
        self.nbytes = int(buf.numel() * buf.element_size())
        self.layout = str(getattr(pool, "layout", "unknown"))
        self.dtype = str(buf.dtype).removeprefix("torch.")
        # DCP pools index pages by logical tokens (page_size x dcp_size).
        self.page_tokens = int(getattr(pool, "logical_page_size", None) or pool.page_size)
        try:
            view0 = pool.get_data_page(0, flat=False)
            view1 = pool.get_data_page(self.page_tokens, flat=False)
        except (ValueError, NotImplementedError) as e:  # a layout SGLang keeps no flat page of
            raise UnsupportedEngine(f"kvtier: SGLang's {self.layout} layout: {e}") from None
        self.first = int(view0.data_ptr())
        self.page_stride = int(view1.data_ptr()) - self.first
        offs, run = _runs(tuple(view0.shape), tuple(view0.stride()), view0.element_size())
        self.runs, self.run_bytes = offs, int(run)
        self.page_bytes = int(view0.numel() * view0.element_size())
        self.num_pages = int(getattr(pool, "page_num", 0) or 0)
        if len(offs) * run != self.page_bytes or self.page_stride <= 0:
            raise UnsupportedEngine(f"kvtier: cannot map pages of SGLang's {self.layout} layout")
        # The last page too: a plan that is right for pages 0 and 1 only
        # would hand the tiers the wrong bytes.
        if self.num_pages > 2:
            last = (self.num_pages - 1) * self.page_tokens
            if int(pool.get_data_page(last, flat=False).data_ptr()) != self.address(last):
                raise UnsupportedEngine(
                    f"kvtier: pages of SGLang's {self.layout} layout are not evenly spaced"
                )
        end = self.first + int(self.runs.max()) + self.run_bytes
        if self.first < self.base or end > self.base + self.nbytes:
            raise UnsupportedEngine("kvtier: SGLang's data page lies outside its KV buffer")

    def address(self, token: int) -> int:
        """Base address of the page that starts at token index ``token``."""
        return self.first + (int(token) // self.page_tokens) * self.page_stride

    def page_starts(self, host_indices: Any, num_pages: int) -> np.ndarray:
        """The base address of each of ``num_pages`` pages given as SGLang's
        token indices (``page_tokens`` per page, the first of each counts)."""
        idx = np.asarray(host_indices.cpu() if hasattr(host_indices, "cpu") else host_indices)
        idx = idx.reshape(-1).astype(np.int64, copy=False)
        if num_pages == 0:
            return np.zeros(0, np.int64)
        step = len(idx) // num_pages
        if step <= 0 or step * num_pages != len(idx):
            raise InvalidArgument(f"{len(idx)} host indices for {num_pages} pages")
        starts = idx[::step]
        if (starts % self.page_tokens).any() or (starts < 0).any():
            raise InvalidArgument("host indices must start pages on page boundaries")
        if self.num_pages and (starts // self.page_tokens >= self.num_pages).any():
            raise InvalidArgument(f"host indices beyond the pool's {self.num_pages} pages")
        return self.first + (starts // self.page_tokens) * self.page_stride

    def descriptors(self, pages: np.ndarray, slots: np.ndarray, to_slots: bool) -> np.ndarray:
        """``(len(pages) * runs, 3)`` int64 copy descriptors ``(src, dst,
        nbytes)`` between pages at ``pages`` and staging slots at ``slots``
        (the flat page order: run ``r`` of a page at byte ``r * run_bytes``
        of its slot); ``to_slots``: pool -> slots, else slots -> pool."""
        n, r = len(pages), len(self.runs)
        pool_side = (pages[:, None] + self.runs[None, :]).reshape(-1)
        slot_side = (
            slots[:, None] + np.arange(r, dtype=np.int64)[None, :] * self.run_bytes
        ).reshape(-1)
        out = np.empty((n * r, 3), np.int64)
        out[:, 0], out[:, 1] = (pool_side, slot_side) if to_slots else (slot_side, pool_side)
        out[:, 2] = self.run_bytes
        return out
