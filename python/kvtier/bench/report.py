"""One page of every benchmark's ratios: ``summary.md`` (a table) and
``summary.png`` (bars against the 1.0 line) from the newest result of each
kind in a results directory.

Who calls: ``bench/run.py`` after a run (``make bench``), or by hand. Blocks
while it reads the files and draws.

A command-line tool's module: runs in the process of ``bench/run.py`` or
of whoever calls it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.bench.plots import pyplot, save_figure


def _size(n: int | None) -> str:
    if not n:
        return ""
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def latest(results_dir: Path) -> list[dict[str, Any]]:
    """The newest result of each (component, block size, device), in name order."""
    newest: dict[tuple[Any, ...], tuple[str, dict[str, Any]]] = {}
    for f in sorted(results_dir.glob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict) or "component" not in d:
            continue
        kind = (d["component"], d.get("block_bytes"), d.get("device"))
        stamp = str(d.get("machine", {}).get("time", f.name))
        if kind not in newest or stamp >= newest[kind][0]:
            newest[kind] = (stamp, d)
    return [d for _, d in sorted(newest.values(), key=lambda x: str(x[1]["component"]))]


def ratios(results: list[dict[str, Any]]) -> list[tuple[str, float, str]]:
    """(what, ratio, baseline) rows; > 1 means kvtier is faster."""
    rows: list[tuple[str, float, str]] = []
    for d in results:
        c, size = d["component"], _size(d.get("block_bytes"))
        if c == "copy" and "ratio" in d:
            rows.append((f"copy {d.get('device', 'host')} {size}", d["ratio"], "memcpy"))
        elif c == "disk":
            for k, v in d.get("ratio", {}).items():
                rows.append((f"disk {size} {k}", v, "fio"))
            for k, v in d.get("vs_python_threadpool", {}).items():
                rows.append((f"disk {size} {k}", v, "Python thread pool"))
            if "gil" in d:
                g = d["gil"]["python_loop_speed_while_busy"]
                rows.append((f"disk {size} Python loop while busy", g, "loop alone"))
                fio = d["gil"].get("loop_beside_fio")
                if fio:
                    g = fio["python_loop_speed_while_busy"]
                    rows.append((f"disk {size} Python loop beside fio", g, "loop alone"))
                th = d["gil"].get("driver_in_second_thread")
                if th:
                    rows.append(
                        (
                            f"disk {size} Python loop, driver in a 2nd thread",
                            th["python_loop_speed_while_busy"],
                            "loop alone",
                        )
                    )
        elif c == "remote":
            for k, v in d.get("ratio", {}).items():
                rows.append((f"remote {size} {k}", v, "redis-benchmark"))
            same = d.get("baseline_same_keyspace", {})
            for k, v in same.get("ratio", {}).items():
                rows.append((f"remote {size} {k}", v, "redis-benchmark -r"))
            for k, v in d.get("vs_redis_py", {}).items():
                rows.append((f"remote {size} {k}", v, "redis-py + hiredis"))
            for name, peer in d.get("peers", {}).items():
                for k, v in peer["ratio"].items():
                    rows.append((f"remote {size} {k}", v, name))
        elif c == "sglang":
            for key, base in (
                ("vs_hicache_file", "SGLang's HiCacheFile"),
                ("vs_hicache_file_device", "HiCacheFile from the device"),
            ):
                for k, v in d.get(key, {}).items():
                    rows.append((f"SGLang backend {k}", v, base))
            for k, v in d.get("redis_vs_redis_py", {}).items():
                rows.append((f"SGLang backend on Redis {k}", v, "redis-py + hiredis"))
        elif c == "vllm":
            if "manager" in d:
                rows.append(("vLLM manager cycles", d["manager"]["ratio"], "CPUOffloadingManager"))
                if "ratio_batch16" in d["manager"]:
                    rows.append(
                        (
                            "vLLM manager cycles, 16 keys a call",
                            d["manager"]["ratio_batch16"],
                            "CPUOffloadingManager",
                        )
                    )
            for part in d.get("disk", []):
                for k, v in part["ratio"].items():
                    rows.append((f"vLLM disk {_size(part['chunk_bytes'])} {k}", v, "vLLM fs tier"))
    return rows


def write_summary(results_dir: Path) -> tuple[Path, Path | None]:
    """Writes summary.md (always) and summary.png (when matplotlib is there)."""
    results = latest(results_dir)
    rows = ratios(results)
    when = max((str(d.get("machine", {}).get("time", "")) for d in results), default="")
    md = results_dir / "summary.md"
    lines = [
        f"# kvtier benchmark ratios ({when})",
        "",
        "kvtier / baseline, both measured in the same run; > 1 is faster than the baseline.",
        "",
        "| what | baseline | ratio |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {w} | {b} | {r:.2f} |" for w, r, b in rows]
    md.write_text("\n".join(lines) + "\n")
    try:
        plt = pyplot()
    except ImportError:
        return md, None
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.2))
    labels = [f"{w}  (vs {b})" for w, _, b in rows][::-1]
    values = [r for _, r, _ in rows][::-1]
    ax.barh(labels, values, color=["tab:green" if v >= 1 else "tab:orange" for v in values])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("kvtier / baseline (same run)")
    ax.set_title(f"kvtier benchmarks {when}")
    ax.tick_params(axis="y", labelsize=8)
    png = results_dir / "summary.png"
    save_figure(fig, png)
    return md, png
