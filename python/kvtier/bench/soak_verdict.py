"""The soak's judging and its report: the acceptance criteria, the per-minute
table, the fault log as text and the plot.

:func:`verdict` judges a run from the driver's per-interval samples
(resources flat after warm-up, no wrong byte, no hang, no crash, recovery
after every fault, :func:`judge_recovery` filling each fault's recovery
time); :func:`flat_at_equal_load` judges the serving soak's open fds and
threads, which follow its connections, at equal load; :func:`minute_rows`
and :func:`format_row` make the table printed as the run goes;
:func:`report` and :func:`plot` show a finished run's record.

A command-line tool's module: runs in the ``kvtier bench soak`` driver
process. Who calls: :func:`kvtier.bench.soak.run_soak`,
:mod:`kvtier.bench.commands` (:func:`report`) and the tests. Pure and
never blocking, but for :func:`plot` (writes a PNG; needs matplotlib).
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.plots import pyplot, save_figure
from kvtier.bench.soak_child import HANG_S
from kvtier.bench.soak_faults import FAULT_KINDS, Fault

FLAT_METRICS = ("rss_kib", "fds", "threads", "shm")
FLAT_TOLERANCE = 0.05  # the "within 5%"
SETTLE_S = 10.0  # a restarted child's first seconds (imports, pool, recovery) are not judged
RECOVERY_SHARE = 0.5  # recovered: a sample's hit rate back to half the rate before the fault
# Open fds and threads follow the connections open (one per request in
# flight): judged only at equal load, on samples with at most this many in flight.
QUIET_IN_FLIGHT = 1
EQUAL_LOAD_SAMPLES = 6  # the fewest that judge: 3 early, 3 late


@dataclass
class Criterion:
    name: str
    passed: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def flatness(
    samples: Sequence[dict[str, Any]],
    metric: str,
    warmup_end: float,
    starts: Iterable[float],
    per_life: bool = False,
) -> tuple[bool, str]:
    """Whether ``metric`` stays within :data:`FLAT_TOLERANCE` above its level
    after warm-up. Judged: samples after ``warmup_end`` and at least
    :data:`SETTLE_S` after any child start (``starts``, same clock as the
    samples' ``t``). The level is the median of the first tenth of them (at
    least 3); the peak of all of them must not pass it by more than 5%. A
    drop (fewer connections while Redis is down) is no leak and passes.
    ``per_life``: a metric of the child's own process (RSS, fds, threads),
    judged over each child's life against that life's own level (a restarted
    child is another process: its heap is laid out anew, and one recovering
    a disk journal settled 4.8% above the killed one's level in a 2-minute CI
    run); a life with fewer than 3 samples to judge joins the one before.
    The worst life's figures are reported. Pure."""
    starts = sorted(starts)

    def settled(t: float) -> bool:
        return all(not (s <= t < s + SETTLE_S) for s in starts)

    judged = [
        s for s in samples if s["t"] >= warmup_end and settled(s["t"]) and s.get("event") != "final"
    ]
    if len(judged) < 3:
        return False, f"only {len(judged)} samples after warm-up to judge"
    lives: list[list[dict[str, Any]]] = [judged]
    if per_life:
        lives, current = [], -1
        for s in judged:
            n = bisect.bisect_right(starts, s["t"])  # the child's incarnation
            if n != current:
                lives.append([])
                current = n
            lives[-1].append(s)
        for i in range(len(lives) - 1, 0, -1):  # short lives join the one before
            if len(lives[i]) < 3:
                lives[i - 1] += lives.pop(i)
        if len(lives[0]) < 3 and len(lives) > 1:
            lives[1] = lives.pop(0) + lives[1]
    worst: tuple[float, bool, str] | None = None
    for life in lives:
        head = life[: max(3, len(life) // 10)]
        level = statistics.median(s[metric] for s in head)
        peak = max(s[metric] for s in life)
        ok = peak <= level * (1 + FLAT_TOLERANCE)
        growth = (peak / level - 1) if level else (0.0 if peak == 0 else float("inf"))
        detail = f"level {level:g}, peak {peak:g} ({growth:+.1%}) over {len(life)} samples"
        if worst is None or growth > worst[0]:
            worst = (growth, ok, detail)
    assert worst is not None
    if len(lives) > 1:
        return worst[1], f"{worst[2]} (the worst of {len(lives)} child lives)"
    return worst[1], worst[2]


def at_equal_load(
    samples: Sequence[dict[str, Any]], warmup_end: float
) -> tuple[int, list[dict[str, Any]]]:
    """The samples after ``warmup_end`` (the final one excluded) taken at
    the same low load: at most :data:`QUIET_IN_FLIGHT` requests in flight
    (their ``in_flight``), the bound raised one at a time until
    :data:`EQUAL_LOAD_SAMPLES` qualify (a machine so loaded that requests
    always overlap). Returns (the bound, those samples); samples that do not
    say their load are left out. Pure."""
    judged = [
        s
        for s in samples
        if s["t"] >= warmup_end and s.get("event") != "final" and s.get("in_flight") is not None
    ]
    top = max((s["in_flight"] for s in judged), default=QUIET_IN_FLIGHT)
    for bound in range(QUIET_IN_FLIGHT, max(top, QUIET_IN_FLIGHT) + 1):
        quiet = [s for s in judged if s["in_flight"] <= bound]
        if len(quiet) >= EQUAL_LOAD_SAMPLES:
            return bound, quiet
    return top, judged


def flat_at_equal_load(
    samples: Sequence[dict[str, Any]], metric: str, warmup_end: float
) -> tuple[bool, str]:
    """Whether ``metric`` (open fds or threads: both follow the connections
    open, one per request in flight) stays within :data:`FLAT_TOLERANCE` at
    equal load: over the samples :func:`at_equal_load` picks, the median of
    the last tenth (at least 3) against the median of the first. The peak
    under load (a burst of long prompts holds a dozen connections) is
    reported, not judged; a descriptor left open per request raises the late
    level by one per request served in between, and fails. Who calls:
    :func:`kvtier.bench.soak_server_check.judge` and the tests. Pure."""
    bound, quiet = at_equal_load(samples, warmup_end)
    if len(quiet) < EQUAL_LOAD_SAMPLES:
        return False, (
            f"only {len(quiet)} samples with at most {bound} requests in flight "
            f"after warm-up to judge"
        )
    n = max(3, len(quiet) // 10)
    early = statistics.median(s[metric] for s in quiet[:n])
    late = statistics.median(s[metric] for s in quiet[-n:])
    ok = late <= early * (1 + FLAT_TOLERANCE)
    growth = (late / early - 1) if early else (0.0 if late == 0 else float("inf"))
    top = max(
        (s for s in samples if s["t"] >= warmup_end and s.get("event") != "final"),
        key=lambda s: s[metric],
    )
    return ok, (
        f"at most {bound} in flight: early {early:g}, late {late:g} ({growth:+.1%}) "
        f"over {len(quiet)} samples; peak {top[metric]:g} at {top.get('in_flight', '?')} in flight"
    )


def hit_rate(samples: Iterable[dict[str, Any]]) -> float:
    """Hits over block references of the samples' intervals together."""
    hits = refs = 0
    for s in samples:
        hits += s["d_hits"]
        refs += s["d_refs"]
    return hits / refs if refs else 0.0


def judge_recovery(fault: Fault, samples: Sequence[dict[str, Any]], until: float) -> None:
    """Fill ``fault.recovered_s``: seconds from the fault's end to the first
    sample (before ``until``, the next fault) whose hit rate is back to
    :data:`RECOVERY_SHARE` of the 15 s before the fault, in which the faulted
    medium works again: Redis stores or loads for ``redis_kill``, disk stores
    for ``disk_full``, hits served by the restarted child for ``process_kill``.
    None: not recovered."""
    before = [s for s in samples if fault.start - 15 <= s["t"] < fault.start]
    want = RECOVERY_SHARE * hit_rate(before)
    after = [s for s in samples if fault.end <= s["t"] < until]
    medium_ok = fault.kind not in ("redis_kill", "disk_full", "process_kill")
    for s in after:
        if fault.kind == "redis_kill":
            medium_ok |= s["d_remote_io"] > 0
        elif fault.kind == "disk_full":
            medium_ok |= s["d_disk_stores"] > 0
        elif fault.kind == "process_kill":  # every sample after its end is the new child's
            medium_ok |= s["d_hits"] > 0
        if medium_ok and s["d_refs"] and s["d_hits"] / s["d_refs"] >= want:
            fault.recovered_s = round(s["t"] - fault.end, 1)
            return


def verdict(
    samples: Sequence[dict[str, Any]],
    faults: Sequence[Fault],
    warmup_end: float,
    starts: Iterable[float],
    hangs: int,
    crashes: int,
    t0: float,
) -> list[Criterion]:
    """Every acceptance criterion of the soak, judged from its records (the
    samples as :class:`~kvtier.bench.soak.Recorder` keeps them; ``t0``: the run's start)."""
    starts = list(starts)
    out = []
    for m in FLAT_METRICS:
        ok, detail = flatness(samples, m, warmup_end, starts, per_life=m != "shm")
        out.append(Criterion(f"{m} flat after warm-up (within 5%)", ok, detail))
    wrong = sum(s["d_wrong"] for s in samples)
    loaded = sum(s["d_hits"] for s in samples)
    out.append(
        Criterion("0 wrong bytes served", wrong == 0, f"{wrong} wrong of {loaded:,} blocks loaded")
    )
    out.append(Criterion("0 hangs", hangs == 0, f"{hangs} steps over {HANG_S:g} s or silent"))
    out.append(Criterion("0 crashes", crashes == 0, f"{crashes} unexpected child exits"))
    done = [f for f in faults if not f.skipped]
    bad = [f"{f.kind} at {f.start - t0:.0f} s" for f in done if f.recovered_s is None]
    kinds = {f.kind for f in done}
    out.append(
        Criterion(
            "recovery after every fault",
            not bad and bool(done),
            f"{len(done) - len(bad)}/{len(done)} recovered"
            + (f"; not: {', '.join(bad)}" if bad else "")
            + f"; kinds run: {len(kinds)}/{len(FAULT_KINDS)}",
        )
    )
    return out


# -- the report -----------------------------------------------------------------
def minute_rows(
    samples: Sequence[dict[str, Any]], faults: Sequence[Fault], t0: float, minutes: int
) -> list[dict[str, Any]]:
    """One row per minute: what happened in it (sums of the intervals ending
    in it) and the resources at its last sample."""
    rows = []
    for m in range(minutes):
        lo, hi = t0 + 60 * m, t0 + 60 * (m + 1)
        ss = [s for s in samples if lo <= s["t"] < hi]
        live = [s for s in ss if s.get("event") != "final"]  # resources before shutdown
        last = live[-1] if live else {}
        rows.append(
            {
                "minute": m + 1,
                "requests": sum(s["d_requests"] for s in ss),
                "hit_rate": round(hit_rate(ss), 4),
                "wrong_blocks": sum(s["d_wrong"] for s in ss),
                "corrupt_caught": sum(s["d_corrupt"] for s in ss),
                "step_max_s": max((s["step_max_s"] for s in ss), default=0.0),
                **{
                    k: last.get(k, 0)
                    for k in ("rss_kib", "fds", "threads", "shm", "lck_kib", "pin_kib")
                },
                "faults": [f.kind for f in faults if lo <= f.start < hi],
            }
        )
    return rows


MINUTE_HEADER = (
    f"{'min':>4} {'requests':>9} {'hit rate':>8} {'wrong':>5} {'corrupt':>7} {'max step':>8} "
    f"{'RSS MiB':>8} {'fds':>4} {'thr':>4} {'shm':>3} {'VmLck':>7} {'VmPin':>5}  faults"
)


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['minute']:>4} {r['requests']:>9,} {r['hit_rate']:>8.1%} {r['wrong_blocks']:>5} "
        f"{r['corrupt_caught']:>7} {r['step_max_s']:>7.2f}s {r['rss_kib'] / 1024:>8.1f} "
        f"{r['fds']:>4} {r['threads']:>4} {r['shm']:>3} {r['lck_kib']:>5}Ki {r['pin_kib']:>3}Ki"
        f"  {', '.join(r['faults'])}"
    )


def report(result: dict[str, Any]) -> str:
    """The fault log and the verdict as text (after the per-minute table)."""
    lines = ["faults:"]
    for f in result["faults"]:
        rec = (
            "skipped: " + f["skipped"]
            if f["skipped"]
            else (
                f"recovered in {f['recovered_s']} s"
                if f["recovered_s"] is not None
                else "NOT recovered"
            )
        )
        lines.append(f"  {f['at_s']:>7.1f} s  {f['kind']:<13} {rec}; {f['detail']}; {f['felt']}")
    counts = ", ".join(f"{k} {n}" for k, n in result["fault_counts"].items())
    lines.append(f"fault counts: {counts}; child starts {result['child_starts']}")
    lines.append("verdict:")
    lines.extend(
        f"  {'PASS' if c['passed'] else 'FAIL'}  {c['name']}: {c['detail']}"
        for c in result["verdict"]
    )
    lines.append(f"soak {'PASSED' if result['passed'] else 'FAILED'}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS, fds and threads, hit rate and /dev/shm entries over time, one
    vertical line per fault. Needs matplotlib."""
    plt = pyplot()

    ss = result["samples"]
    xs = [s["at_s"] / 60 for s in ss]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    series = [
        ("RSS (MiB)", [s["rss_kib"] / 1024 for s in ss]),
        ("open fds / threads", None),
        (
            "hit rate per interval (%)",
            [100 * s["d_hits"] / s["d_refs"] if s["d_refs"] else 0 for s in ss],
        ),
        ("/dev/shm pools", [s["shm"] for s in ss]),
    ]
    for ax, (label, ys) in zip(axes, series, strict=True):
        if ys is None:
            ax.plot(xs, [s["fds"] for s in ss], ".-", label="fds")
            ax.plot(xs, [s["threads"] for s in ss], ".-", label="threads")
            ax.legend(loc="lower right")
        else:
            ax.plot(xs, ys, ".-")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        colors = dict(
            zip(
                FAULT_KINDS,
                ("tab:red", "tab:blue", "tab:orange", "tab:green", "black"),
                strict=True,
            )
        )
        for f in result["faults"]:
            if not f["skipped"]:
                ax.axvline(f["at_s"] / 60, color=colors[f["kind"]], alpha=0.5, lw=1)
    axes[-1].set_xlabel(
        "minutes (vertical lines: faults; "
        + ", ".join(
            f"{c}: {k}"
            for k, c in zip(FAULT_KINDS, ("red", "blue", "orange", "green", "black"), strict=True)
        )
        + ")"
    )
    axes[0].set_title(
        f"kvtier bench soak, {result['config']['minutes']:g} min: "
        + ("PASSED" if result["passed"] else "FAILED")
    )
    save_figure(fig, path, dpi=100)
