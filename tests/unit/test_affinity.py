"""kvtier's threads started from a thread bound to compute cores run on the
other cores (as in vLLM's CPU worker); unbound, nothing changes."""

from __future__ import annotations

import os
import threading

import pytest
from kvtier.affinity import off_compute_cpus, spare_cpus
from kvtier.bench.serve_load import _parse_cpus

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least 2 CPUs to bind a thread to a strict subset",
)


def _in_thread(fn):  # type: ignore[no-untyped-def]
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_threads_started_inside_run_off_the_callers_cpus() -> None:
    allowed = os.sched_getaffinity(0)
    compute = {min(allowed)}

    def bound() -> tuple[set[int] | None, set[int], set[int]]:
        os.sched_setaffinity(0, compute)  # as vLLM binds its OpenMP master
        with off_compute_cpus() as spare:
            child = _in_thread(lambda: os.sched_getaffinity(0))
        return spare, child, os.sched_getaffinity(0)

    spare, child, after = _in_thread(bound)
    assert spare == allowed - compute
    assert child == allowed - compute  # the started thread: the other cores
    assert after == compute  # the caller's own binding is restored


def test_an_unbound_thread_changes_nothing() -> None:
    assert spare_cpus() is None
    with off_compute_cpus() as spare:
        assert spare is None
        assert _in_thread(lambda: os.sched_getaffinity(0)) == os.sched_getaffinity(0)


def test_parse_cpus_reads_vllm_binding_lists() -> None:
    assert _parse_cpus("0") == {0}
    assert _parse_cpus("0-2,5") == {0, 1, 2, 5}
    assert _parse_cpus("auto") == set()
    assert _parse_cpus("0-x") == set()
