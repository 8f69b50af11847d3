"""The serving soak's checks and report: the disk tier reopened and every
record verified (:func:`check_disk`), the verdict (:func:`judge`: no crash,
no lost request, tokens identical to the reference, resources flat (open
fds and threads at equal load), kvtier's counters consistent with the
faults, nothing held at shutdown), each fault's effect on the requests
around it, the text report and the plot.

A command-line tool's module: runs in the ``kvtier bench soak --server``
driver process. Who calls: :mod:`kvtier.bench.soak_server`,
:mod:`kvtier.bench.commands` (:func:`report`) and the tests. Pure and never
blocking, but for :func:`check_disk` (blocks reading the tier's files) and
:func:`plot` (writes a PNG).
"""

from __future__ import annotations

import statistics
import struct
from pathlib import Path
from typing import Any

from kvtier.bench.plots import pyplot, save_figure
from kvtier.bench.soak_verdict import FLAT_TOLERANCE, at_equal_load, flat_at_equal_load, flatness

FLAT = ("rss_kib", "fds", "threads", "shm", "shm_mib")
# Each request in flight holds a connection, an fd of the server's: fds (and
# threads, which a server may start per connection) are judged at equal load,
# not by their peak, which a burst of requests sets (a 3-minute run: fds
# 188 -> 205 at the peak, 185-192 whenever at most one request was in flight).
FOLLOW_LOAD = ("fds", "threads")
_TRAILER = struct.Struct("<IHHQ16s16sII8s")  # csrc/core/disk/record.h's Trailer
_MAGIC = 0x5254564B


def check_disk(root: Path, block_bytes: int, corrupted: list[tuple[str, int]]) -> dict[str, Any]:
    """Reopen each tier directory under ``root`` as the disk tier does at
    start (its checkpoint and journal recovered into a fresh native index)
    and verify every record: the recovered ones (trailer, namespace, the
    index's key digest, payload crc32c) and every other record that holds a
    trailer. ``corrupted``: (slab file, record) the soak flipped bytes in.
    Blocks while it reads the slabs."""
    from kvtier import _native
    from kvtier.engine import crc32c
    from kvtier.tiers.disk.journal import IndexJournal
    from kvtier.tiers.records import record_bytes

    rb = record_bytes(block_bytes)
    toff = -(-block_bytes // 4096) * 4096
    hurt = {(Path(p).name, r) for p, r in corrupted}
    out: dict[str, Any] = {
        "directories": 0,
        "records": 0,
        "recovered": 0,
        "recovered_ok": 0,
        "written": 0,
        "written_ok": 0,
        "bad": [],
        "bad_not_injected": [],
        "injected": len(hurt),
        "injected_still_bad": 0,
    }
    for d in sorted(root.glob("kvtier-*")):
        slabs = sorted(d.glob("slab-*.dat"))
        if not slabs:
            continue
        per_file = slabs[0].stat().st_size // rb
        n = sum(p.stat().st_size // rb for p in slabs)
        index = _native.DiskIndex(n)
        journal = IndexJournal(d, block_bytes, n, False)
        journal.recover(index)
        index.rebuild()
        journal.close()
        ready = {int(r) for r in index.ready_records()}
        out["directories"] += 1
        out["records"] += n
        out["recovered"] += len(ready)
        ns: set[bytes] = set()
        for fi, p in enumerate(slabs):
            with p.open("rb") as f:
                for i in range(p.stat().st_size // rb):
                    rec = fi * per_file + i
                    f.seek(i * rb)
                    data = f.read(rb)
                    t = _TRAILER.unpack_from(data, toff)
                    if t[0] != _MAGIC and rec not in ready:
                        continue  # never written
                    head_ok = (
                        t[0] == _MAGIC
                        and t[1] == 1
                        and t[3] == block_bytes
                        and t[7] == crc32c(memoryview(data)[toff : toff + 52])
                    )
                    ok = head_ok and t[6] == crc32c(memoryview(data)[:block_bytes])
                    if rec in ready:
                        ok = ok and index.holds(rec, t[5])
                        out["recovered_ok"] += ok
                    out["written"] += 1
                    out["written_ok"] += ok
                    if head_ok:
                        ns.add(t[4])
                    if not ok:
                        where = {
                            "file": f"{d.name}/{p.name}",
                            "record": i,
                            "recovered": rec in ready,
                        }
                        out["bad"].append(where)
                        if (p.name, i) in hurt:
                            out["injected_still_bad"] += 1
                        else:
                            out["bad_not_injected"].append(where)
        out.setdefault("namespaces", 0)
        out["namespaces"] += len(ns)
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _slope(samples: list[dict[str, Any]], key: str) -> float:
    """Least-squares slope per minute."""
    if len(samples) < 2:
        return 0.0
    xs = [s["t"] / 60 for s in samples]
    ys = [float(s[key]) for s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def fault_effects(result: dict[str, Any], reqs: list[dict[str, Any]]) -> None:
    """Per fault: the requests sent from its start to 5 s after its end
    (TTFT p50 and max against the run's p50 outside every fault, failures),
    and the metrics' growth over the same window."""
    t0 = result["t0"]
    windows = [(t0 + f["at_s"], max(f["end"], t0 + f["at_s"]) + 5.0) for f in result["faults"]]
    quiet = [
        r["ttft_s"]
        for r in reqs
        if r["ttft_s"] is not None
        and r["kind"] != "burst"
        and not any(a <= r["sent"] <= b for a, b in windows)
    ]
    base = _pct(quiet, 0.5)
    result["ttft_p50_outside_faults_ms"] = None if base is None else round(1e3 * base, 1)
    samples = [s for s in result["samples"] if s["metrics"]]
    for f, (a, b) in zip(result["faults"], windows, strict=True):
        inw = [r for r in reqs if a <= r["sent"] <= b]
        tt = [r["ttft_s"] for r in inw if r["ttft_s"] is not None]
        before = [s for s in samples if s["t"] <= a]
        after = [s for s in samples if s["t"] >= b] or samples[-1:]
        m0 = before[-1]["metrics"] if before else {}
        m1 = after[0]["metrics"] if after else {}
        grew = {
            k: round(v - m0.get(k, 0.0), 1)
            for k, v in m1.items()
            if v - m0.get(k, 0.0)
            and not k.startswith(("request_success", "prompt_tokens"))
            and k not in ("num_requests_running", "num_requests_waiting")
        }
        f["effect"] = {
            "requests": len(inw),
            "answered": sum(r["status"] == "answered" for r in inw),
            "aborted": sum(r["status"] == "aborted" for r in inw),
            "failed": sum(r["status"] == "failed" for r in inw),
            "ttft_p50_ms": None if not tt else round(1e3 * statistics.median(tt), 1),
            "ttft_max_ms": None if not tt else round(1e3 * max(tt), 1),
            "metrics_grew": grew,
        }


def judge(result: dict[str, Any], reqs: dict[int, Any], reference: dict[int, list[int]]) -> None:
    """Fill ``result["verdict"]``, ``["passed"]``, ``["tokens"]``,
    ``["resources"]`` and each fault's ``effect``. Pure."""
    rs = result["requests"]
    crit: list[dict[str, Any]] = []

    def add(name: str, ok: bool, detail: str) -> None:
        crit.append({"name": name, "passed": bool(ok), "detail": detail})

    add(
        "no server crash",
        not result["crashes"] and result["server_exit"] in (0, -2, 130),
        f"{result['crashes'] or 'none'}; exit {result['server_exit']} after SIGINT",
    )
    lost = [r["id"] for r in rs if r["status"] in ("failed", "pending")]
    aborted = [r for r in rs if r["status"] == "aborted"]
    unplanned = [r["id"] for r in aborted if not r["abort"]]
    planned = set(result["abort_ids"])
    add(
        "no request lost",
        not lost and not unplanned and {r["id"] for r in aborted} == planned,
        f"{len(rs)} sent: {sum(r['status'] == 'answered' for r in rs)} answered, "
        f"{len(aborted)} aborted on purpose (of {len(planned)} planned), lost {lost[:20]}"
        + (f"; errors: {sorted({r['error'] for r in rs if r['error']})[:5]}" if lost else ""),
    )
    wrong, compared, tokens = [], 0, 0
    for i, want in reference.items():
        got = reqs[i].tokens
        compared += 1
        tokens += len(got)
        if got != want[: len(got)] or (reqs[i].status == "answered" and got != want):
            first = next(
                (k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            wrong.append({"id": i, "kind": reqs[i].kind, "first_diff": first, "tokens": len(got)})
    result["tokens"] = {
        "compared_requests": compared,
        "compared_tokens": tokens,
        "wrong_requests": wrong,
    }
    add(
        "tokens identical to the reference server",
        compared > 0 and not wrong,
        f"{len(wrong)} of {compared} requests differ ({tokens:,} tokens compared)",
    )
    live = [s for s in result["samples"] if s.get("event") != "final"]
    warm_end = result["t0"] + result["config"]["warmup_s"]
    res = {}
    for k in FLAT:
        if k in FOLLOW_LOAD:
            ok, detail = flat_at_equal_load(live, k, warm_end)
            judged = at_equal_load(live, warm_end)[1]
            name = (
                f"{k} flat after warm-up at equal load (late within {FLAT_TOLERANCE:.0%} of early)"
            )
        else:
            ok, detail = flatness(live, k, warm_end, [])
            judged = [s for s in live if s["t"] >= warm_end]
            name = f"{k} flat after warm-up (peak within {FLAT_TOLERANCE:.0%} of its level)"
        slope = _slope(judged, k)
        level = (
            statistics.median(s[k] for s in judged[: max(3, len(judged) // 10)]) if judged else 0
        )
        res[k] = {
            "flat": ok,
            "detail": detail,
            "slope_per_min": round(slope, 3),
            "slope_share_per_min": round(slope / level, 5) if level else 0.0,
        }
        add(name, ok, f"{detail}; slope {slope:+.3g}/min")
    result["resources"] = res
    fault_effects(result, rs)
    stats = result["kvtier_stats"]
    if stats is None:
        add("nothing held at shutdown", False, "no kvtier stats JSON at shutdown")
    else:
        occ, closed = stats["occupancy"], stats["closed_occupancy"]
        held = {k: occ[k] for k in ("pinned", "writing", "held", "stale", "streaming")}
        add(
            "nothing held at shutdown",
            not any(held.values()) and not closed["tier_jobs"],
            f"at shutdown {held}, tier jobs after close {closed['tier_jobs']}, "
            f"pending work {stats['pending_work']}",
        )
    add("counters consistent with the faults", *_counters(result))
    d = result["disk_reopen"]
    add(
        "disk tier reopens, every surviving record verified",
        d["directories"] == 1
        and not d["bad_not_injected"]
        and d["recovered"] > 0
        and d.get("namespaces", 0) == 1,
        f"{d['recovered']} records recovered, {d['recovered_ok']} verified; "
        f"{d['written_ok']}/{d['written']} written records verify; "
        f"{d['injected_still_bad']} of {d['injected']} corrupted records still there (caught); "
        f"bad records not corrupted by the soak: {len(d['bad_not_injected'])}",
    )
    counts = {
        k: sum(f["kind"] == k and not f["skipped"] for f in result["faults"])
        for k in result["config"]["kinds"]
    }
    result["fault_counts"] = counts
    add("every fault kind injected", bool(counts) and all(counts.values()), str(counts))
    result["verdict"] = crit
    result["passed"] = all(c["passed"] for c in crit)


def _grew_during(result: dict[str, Any], kind: str, metric: str) -> float:
    """How much the server's ``metric`` surely grew inside the windows of
    the faults of ``kind``: from the first sample at or after each start to
    the last at or before its end (samples come every few seconds: growth
    between the sample before a start and the start is not the fault's)."""
    ss = [x for x in result["samples"] if x["metrics"]]
    total = 0.0
    for f in result["faults"]:
        if f["kind"] != kind or f["skipped"]:
            continue
        end = f["end"] or f["start"]
        inside = [x for x in ss if f["start"] <= x["t"] <= end]
        if len(inside) >= 2:
            first, last = inside[0]["metrics"], inside[-1]["metrics"]
            total += last.get(metric, 0.0) - first.get(metric, 0.0)
    return total


def _counters(result: dict[str, Any]) -> tuple[bool, str]:
    """kvtier's and vLLM's counters against the faults run: corrupt records
    caught, refused disk writes, remote errors, preemptions, Redis written
    again after its empty restart."""
    kinds = {f["kind"] for f in result["faults"] if not f["skipped"]}
    stats = result["kvtier_stats"] or {}
    tiers = stats.get("tiers", {})
    disk, remote = tiers.get("disk", {}), tiers.get("remote", {})
    last: dict[str, float] = next(
        (s["metrics"] for s in reversed(result["samples"]) if s["metrics"]), {}
    )
    facts = {
        "disk_corrupt": disk.get("corrupt", 0),
        "disk_nospace": disk.get("nospace", 0),
        "disk_io_errors": disk.get("io_errors", 0),
        "disk_io_error_codes": disk.get("io_error_codes", {}),
        "disk_load_failures": disk.get("load_failures", 0),
        "remote_errors": sum(remote.get(k, 0) for k in ("io_errors", "server_errors")),
        "remote_load_failures": remote.get("load_failures", 0),
        "remote_corrupt": remote.get("corrupt", 0),
        "promotion_failures": stats.get("stats", {}).get("promotion_failures", 0),
        "cascade_failures": stats.get("stats", {}).get("cascade_failures", 0),
        "load_failures": stats.get("stats", {}).get("load_failures", 0),
        "preemptions": last.get("num_preemptions", 0.0),
        "redis_keys_at_end": result["redis_keys_at_end"],
        "aborted_by_vllm": last.get("request_success_abort", 0.0),
    }
    result["counters"] = facts
    bad = []
    # Caught in service: by the scheduler's own reads (``corrupt``), or by a
    # worker reading the record itself, which reports the read failed
    # without its reason (``load_failures``: no other fault of this soak
    # fails a disk read).
    # A corruption window no read reached (the disk tier's reads flat over
    # it, none failed) tests nothing, and is said so rather than failed: a
    # CI run once had no disk read in 8.4 s of corruption. Its reads, not
    # the engine's loads of blocks promoted from disk (kvtier_loaded_disk),
    # which may have been read before the corruption: a CI run failed on 30
    # such loads, all between the sample before the fault and its start.
    facts["disk_reads_while_corrupting"] = _grew_during(result, "corrupt_disk", "kvtier_disk_reads")
    if (
        "corrupt_disk" in kinds
        and (facts["disk_reads_while_corrupting"] or facts["disk_load_failures"])
        and not (
            facts["disk_corrupt"]
            or facts["disk_load_failures"]
            or result["disk_reopen"]["injected_still_bad"]
        )
    ):
        bad.append("corrupt records neither caught in service nor found on reopen")
    if "disk_full" in kinds and not facts["disk_nospace"]:
        bad.append("no disk write refused while the file system was full")
    if {"redis_kill", "redis_stall"} & kinds and not facts["remote_errors"]:
        bad.append("no remote error counted across Redis faults")
    if "redis_kill" in kinds and not facts["redis_keys_at_end"]:
        bad.append("nothing stored in Redis after its restart")
    if "kv_pressure" in kinds and not facts["preemptions"]:
        bad.append("no preemption under KV-cache pressure")
    if facts["remote_corrupt"]:
        bad.append("corrupt values from Redis, which the soak never corrupts")
    return not bad and bool(stats), ("; ".join(bad) + "; " if bad else "") + str(facts)


def report(result: dict[str, Any]) -> str:
    """The fault log with each fault's effect, and the verdict, as text."""
    lines = ["faults:"]
    for f in result["faults"]:
        e = f.get("effect", {})
        lines.append(
            f"  {f['at_s']:>7.1f} s  {f['kind']:<14} {f['skipped'] or f['detail']}; "
            f"{e.get('requests', 0)} requests (TTFT p50 {e.get('ttft_p50_ms')} ms, max "
            f"{e.get('ttft_max_ms')} ms, {e.get('failed', 0)} failed); {e.get('metrics_grew', {})}"
        )
    lines.append(f"TTFT p50 outside faults: {result.get('ttft_p50_outside_faults_ms')} ms")
    lines += _worker_memory(result)
    lines.append("verdict:")
    lines += [
        f"  {'PASS' if c['passed'] else 'FAIL'}  {c['name']}: {c['detail']}"
        for c in result["verdict"]
    ]
    lines.append(f"soak --server {'PASSED' if result['passed'] else 'FAILED'}")
    return "\n".join(lines)


def _anon_mib(sample: dict[str, Any]) -> int:
    """vLLM's worker's anonymous memory in a sample (MiB; 0 before the split)."""
    procs = sample.get("processes", {})
    return int(sum(v.get("anon_kib", 0) for k, v in procs.items() if "Worker" in k)) >> 10


def _worker_memory(result: dict[str, Any]) -> list[str]:
    """vLLM's worker's anonymous memory (MiB) from the first to the last
    sample, on the soak's server and on the reference over the same prompts:
    the reference says how much of a growth is vLLM's own."""

    anon = _anon_mib
    out = []
    live = [s for s in result["samples"] if s.get("event") != "final"]
    if live and anon(live[-1]):  # runs before the RSS split have no anon_kib
        out.append(f"vLLM worker anonymous memory: {anon(live[0])} -> {anon(live[-1])} MiB")
    ref = result.get("reference_memory")
    if ref:
        out.append(
            f"  on the reference (no kvtier, the same prompts): "
            f"{anon(ref['start'])} -> {anon(ref['end'])} MiB"
        )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput, TTFT and the server's memory, fds and threads over time,
    one labelled vertical line per fault. Needs matplotlib."""
    plt = pyplot()

    t0 = result["t0"]
    rs = [r for r in result["requests"] if r["done"]]
    end = max([r["done"] - t0 for r in rs] + [60.0])
    width = 10.0 if end > 300 else 5.0
    bins = int(end // width) + 1
    done, toks = [0] * bins, [0] * bins
    for r in rs:
        b = int((r["done"] - t0) // width)
        if 0 <= b < bins:
            done[b] += r["status"] == "answered"
            toks[b] += len(r["tokens"])
    xs = [(i + 0.5) * width / 60 for i in range(bins)]
    fig, ax = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    ax[0].plot(xs, [d / width for d in done], ".-", label="answered requests/s")
    ax[0].plot(xs, [t / width / 10 for t in toks], ".-", label="output tokens/s / 10")
    ax[0].legend(loc="upper right", fontsize=8)
    ax[0].set_ylabel("throughput")
    for status, mark in (("answered", "."), ("aborted", "x"), ("failed", "v")):
        sel = [r for r in rs if r["status"] == status and r["ttft_s"] is not None]
        ax[1].plot(
            [(r["sent"] - t0) / 60 for r in sel],
            [1e3 * r["ttft_s"] for r in sel],
            mark,
            ms=3,
            label=status,
        )
    ax[1].set_yscale("log")
    ax[1].set_ylabel("TTFT (ms)")
    ax[1].legend(loc="upper right", fontsize=8)
    ss = [s for s in result["samples"] if s.get("event") != "final"]
    sx = [(s["t"] - t0) / 60 for s in ss]
    ax[2].plot(sx, [s["rss_kib"] / 1024 for s in ss], ".-", label="RSS, all server processes")
    ax[2].plot(sx, [s["shm_mib"] for s in ss], ".-", label="shared memory mapped")
    if ss and _anon_mib(ss[-1]):
        ax[2].plot(sx, [_anon_mib(s) for s in ss], ".-", label="vLLM worker, anonymous")
    ax[2].set_ylabel("MiB")
    ax[2].legend(loc="center right", fontsize=8)
    ax[3].plot(sx, [s["fds"] for s in ss], ".-", label="open fds")
    ax[3].plot(sx, [s["threads"] for s in ss], ".-", label="threads")
    ax[3].legend(loc="center right", fontsize=8)
    ax[3].set_xlabel("minutes")
    colors = dict(
        zip(
            sorted({f["kind"] for f in result["faults"]}),
            [plt.get_cmap("tab10")(i) for i in range(10)],
            strict=False,
        )
    )
    for a in ax:
        a.grid(alpha=0.3)
        for f in result["faults"]:
            if not f["skipped"]:
                a.axvline(f["at_s"] / 60, color=colors[f["kind"]], alpha=0.6, lw=1)
    for f in result["faults"]:
        if not f["skipped"]:
            ax[0].annotate(
                f["kind"],
                (f["at_s"] / 60, 1),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=6,
                va="top",
                color=colors[f["kind"]],
            )
    ax[0].set_title(
        f"kvtier bench soak --server, {result['config']['minutes']:g} min: "
        + ("PASSED" if result["passed"] else "FAILED")
    )
    save_figure(fig, path, dpi=100)
