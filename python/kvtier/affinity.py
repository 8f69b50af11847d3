"""Keep kvtier's threads off the cores an engine computes on.

Any process. Who calls: the vLLM shim's worker, around starting its copy
threads (they inherit the CPU set of the thread that starts them). Never
blocks.

Why: vLLM's CPU engine binds its OpenMP master (the worker's main thread)
to the compute cores, so every thread started from it afterwards, kvtier's
included, ran on those cores, preempting the model's own threads while the
other cores sat partly idle (measured on 2 cores, one bound for compute:
all 48 threads of the engine's worker on core 0). On a GPU engine the
worker's thread is not bound and nothing changes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["off_compute_cpus", "spare_cpus"]


def spare_cpus() -> set[int] | None:
    """CPUs this process may use that the calling thread is not bound to, or
    None: the thread may run anywhere the process may (not bound), or no CPU
    would be left. Linux only (None elsewhere)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    mine = os.sched_getaffinity(0)
    # The process's own CPUs: its parent's (vLLM's engine core, unbound),
    # within what the machine has.
    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        allowed = set(range(os.cpu_count() or 1))
    spare = allowed - mine
    if not spare or mine >= allowed:
        return None
    return spare


@contextlib.contextmanager
def off_compute_cpus() -> Iterator[set[int] | None]:
    """Threads started inside run on :func:`spare_cpus` (yielded; None: no
    change); the calling thread's own CPU set is restored on exit."""
    spare = spare_cpus()
    if spare is None:
        yield None
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, spare)
    try:
        yield spare
    finally:
        os.sched_setaffinity(0, mine)
