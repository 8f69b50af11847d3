"""A memory probe for the serving soak's vLLM processes (issue 52's RSS study).

Not part of kvtier: Python imports this ``sitecustomize`` at start-up when
its directory is on ``PYTHONPATH``, so ``bench/soak_rss_control.py --env
PYTHONPATH=bench/results/soak-server/rss-control/probe`` runs it in vLLM's
API server, engine core and worker alike. Each process starts a daemon
thread that, every 20 s, appends one line to ``$RSS_PROBE_DIR/log-PID.txt``
(default ``/tmp/rss-probe``): glibc's heap (``mallinfo2``: arena bytes, in
use, free, mapped on their own) and the count of live Python objects with
the types that grew most since the last line. Native growth shows as bytes
in use rising while the objects stay flat. Never blocks the process: the
thread sleeps between lines and a failing line is logged, not raised.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import os
import sys
import threading
import time
from pathlib import Path

_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _probe(period_s: float = 20.0) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    out = Path(os.environ.get("RSS_PROBE_DIR", "/tmp/rss-probe"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"log-{os.getpid()}.txt"
    prev: collections.Counter[str] | None = None
    while True:
        time.sleep(period_s)
        try:
            m = libc.mallinfo2()
            count = collections.Counter(type(o).__name__ for o in gc.get_objects())
            grew = []
            if prev is not None:
                diff = {k: count[k] - prev.get(k, 0) for k in count}
                grew = sorted(diff.items(), key=lambda kv: -kv[1])[:8]
            prev = count
            mib = 1 << 20
            line = (
                f"{time.time():.0f} argv={sys.argv[:2]} arena={m.arena // mib}M "
                f"inuse={m.uordblks // mib}M free={m.fordblks // mib}M "
                f"mmap={m.hblkhd // mib}M hblks={m.hblks} objs={sum(count.values())} grew={grew}\n"
            )
        except Exception as e:  # a probe must not take its process down
            line = f"{time.time():.0f} error {e!r}\n"
        with path.open("a") as f:
            f.write(line)


threading.Thread(target=_probe, daemon=True, name="rss-probe").start()
