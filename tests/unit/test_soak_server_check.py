"""The serving soak's counter check (kvtier.bench.soak_server_check._counters)
on made-up runs: a corruption window counts the disk tier's own reads inside
it, not loads of blocks read before it."""

from __future__ import annotations

from typing import Any

from kvtier.bench.soak_server_check import _counters

NOT_CAUGHT = "corrupt records neither caught in service nor found on reopen"


def _run(samples: list[tuple[float, dict[str, float]]], disk: dict[str, int]) -> dict[str, Any]:
    """A run with one corruption fault from t=10 to t=20 and ``samples``
    (t, the server's kvtier metrics) every few seconds."""
    return {
        "faults": [{"kind": "corrupt_disk", "skipped": "", "start": 10.0, "end": 20.0}],
        "samples": [{"t": t, "metrics": m} for t, m in samples],
        "kvtier_stats": {"tiers": {"disk": disk, "remote": {}}, "stats": {}},
        "redis_keys_at_end": 0,
        "disk_reopen": {"injected_still_bad": 0},
    }


def _reads(*at: tuple[float, float]) -> list[tuple[float, dict[str, float]]]:
    return [(t, {"kvtier_disk_reads": n, "kvtier_loaded_disk": n}) for t, n in at]


def test_reads_before_the_window_do_not_make_it_exercised() -> None:
    # 30 reads between the sample before the start and the start, none after
    # (a CI run's 30 "reads while corrupting"): nothing in the window read.
    run = _run(_reads((8.0, 100), (10.5, 130), (12.5, 130), (19.5, 130), (21.0, 130)), {})
    ok, detail = _counters(run)
    assert ok, detail
    assert run["counters"]["disk_reads_while_corrupting"] == 0


def test_reads_inside_the_window_with_nothing_caught_fail() -> None:
    run = _run(_reads((8.0, 100), (10.5, 100), (15.0, 104), (19.5, 107), (21.0, 107)), {})
    ok, detail = _counters(run)
    assert not ok and NOT_CAUGHT in detail
    assert run["counters"]["disk_reads_while_corrupting"] == 7


def test_reads_inside_the_window_with_a_failed_read_pass() -> None:
    samples = _reads((8.0, 100), (10.5, 100), (15.0, 104), (19.5, 107), (21.0, 107))
    ok, detail = _counters(_run(samples, {"load_failures": 2, "corrupt": 1}))
    assert ok, detail


def test_loads_of_promoted_blocks_alone_are_not_reads() -> None:
    # The engine loaded blocks promoted from disk earlier; the disk read none.
    samples = [
        (t, {"kvtier_disk_reads": 50.0, "kvtier_loaded_disk": n})
        for t, n in ((8.0, 10), (10.5, 10), (15.0, 30), (19.5, 40), (21.0, 40))
    ]
    run = _run(samples, {})
    ok, detail = _counters(run)
    assert ok, detail
    assert run["counters"]["disk_reads_while_corrupting"] == 0
