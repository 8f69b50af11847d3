"""The report of ``kvtier bench copy --device cuda``
(:mod:`kvtier.bench.device_cuda`): the GPU's facts (name, driver, PCIe
link, CUDA and torch versions) and the human-readable table.

A command-line tool's module: runs in the ``kvtier`` process. Who calls:
:func:`kvtier.bench.device_cuda_run.run_device_cuda` (:func:`gpu_facts`, which
blocks up to 10 s on nvidia-smi) and :mod:`kvtier.bench.commands`
(:func:`table`, pure; :func:`plot`, which writes a PNG).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from kvtier.bench.device_cuda import CONTENDERS


def _link_from_sysfs(bus: str) -> dict[str, Any]:
    """PCIe link of ``bus`` (``0000:1b:00.0``) from sysfs, if readable."""
    d = Path("/sys/bus/pci/devices") / bus
    gens = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}
    out: dict[str, Any] = {}
    for key, f in (("current", "current_link"), ("max", "max_link")):
        try:
            speed = (d / f"{f}_speed").read_text().split()[0]
            out[f"pcie_gen_{key}"] = gens.get(speed, speed)
            out[f"pcie_width_{key}"] = int((d / f"{f}_width").read_text().strip())
        except (OSError, ValueError, IndexError):
            pass
    return out


def gpu_facts(torch: Any, device: int) -> dict[str, Any]:
    """GPU name, driver, PCIe link (nvidia-smi, else sysfs), CUDA and torch
    versions: what a reader needs to compare runs. Blocks up to 10 s."""
    p = torch.cuda.get_device_properties(device)
    facts: dict[str, Any] = {
        "gpu": p.name,
        "gpu_memory_bytes": int(p.total_memory),
        "compute_capability": f"{p.major}.{p.minor}",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
    }
    bus = None
    if getattr(p, "pci_bus_id", None) is not None:
        bus = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        facts["pci_bus_id"] = bus
    fields = (
        "pci.bus_id",
        "driver_version",
        "pcie.link.gen.current",
        "pcie.link.width.current",
        "pcie.link.gen.max",
        "pcie.link.width.max",
    )
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    lines = [[x.strip() for x in ln.split(",")] for ln in out.splitlines() if ln.count(",") == 5]
    mine = [x for x in lines if bus and x[0].lower().split(":", 1)[-1] == bus.split(":", 1)[1]]
    row = mine[0] if mine else (lines[0] if len(lines) == 1 else None)
    if row is not None:
        names = (
            "driver",
            "pcie_gen_current",
            "pcie_width_current",
            "pcie_gen_max",
            "pcie_width_max",
        )
        for k, v in zip(names, row[1:]):
            facts[k] = int(v) if v.isdigit() else v
    elif bus:
        facts.update(_link_from_sysfs(bus))
    return facts


def _cell(r: dict[str, Any] | None) -> str:
    return f"{r['gbps']:6.1f} ({r['ratio_to_ceiling']:.2f})" if r else " " * 13


def table(result: dict[str, Any]) -> str:
    """The human-readable report of :func:`run_device_cuda`'s result. Pure."""
    g = result.get("gpu", {})
    link = f"PCIe gen{g.get('pcie_gen_current', '?')} x{g.get('pcie_width_current', '?')}"
    rt = result.get("kvtier_runtime", {})
    lines = [
        f"[copy cuda] {g.get('gpu', '?')}, driver {g.get('driver', '?')}, CUDA {g.get('cuda')}, "
        f"torch {g.get('torch')}, {link}; kvtier's runtime {rt.get('runtime')} "
        f"({rt.get('runtime_version')})",
        "  GB/s (fraction of the ceiling); batched/gather: kvtier batched over torch's gather",
    ]
    rows = result.get("rows", [])
    lines += [
        f"  ceiling {r['direction']:>4}: {r['gbps']:.1f} GB/s"
        for r in rows
        if r["measure"] == "ceiling"
    ]
    head = "".join(f"{c.replace('_', ' '):>17}" for c in CONTENDERS)
    lines.append(f"  {'layout':<12}{'tokens':>6}{'page':>10} {'dir':>4}{head}  batched/gather")
    copies: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["measure"] == "copy" and "skipped" in r:
            lines.append(f"  {r['layout']:<12}{r['tokens_per_block']:>6}  skipped: {r['skipped']}")
        elif r["measure"] == "copy":
            key = (r["layout"], r["tokens_per_block"], r["page_bytes"], r["direction"])
            copies.setdefault(key, {})[r["contender"]] = r
    for (layout, tokens, page, d), by in copies.items():
        cells = "".join(f"{_cell(by.get(c)):>17}" for c in CONTENDERS)
        vs = by.get("kvtier_batched", {}).get("ratio_to_torch_gather")
        vs_text = f"{vs:14.2f}" if vs is not None else ""
        lines.append(f"  {layout:<12}{tokens:>6}{page >> 10:>7}KiB {d:>4}{cells}  {vs_text}")
    for r in rows:
        if r["measure"] == "pool_setup" and "skipped" in r:
            lines.append(f"  pool of {r['bytes'] >> 20} MiB: skipped ({r['skipped']})")
        elif r["measure"] == "pool_setup":
            lines.append(
                f"  pool of {r['bytes'] >> 20} MiB: create {r['pool_create_s_per_gib']:.3f} + "
                f"register {r['register_s_per_gib']:.3f} s/GiB vs torch pinned "
                f"{r['torch_pinned_s_per_gib']:.3f} s/GiB: {r['ratio_to_torch_pinned']:.2f}x"
            )
        elif r["measure"] == "do_no_harm":
            lines.append(
                f"  decode step beside {r['contender']} ({r['copy_gbps_meanwhile']:.1f} GB/s): "
                f"{r['step_ms_busy']:.3f} ms vs {r['step_ms_alone']:.3f} alone, "
                f"slowdown {r['slowdown']:.3f}"
            )
    lines.append(f"  {result.get('seconds', '?')} s in all")
    return "\n".join(lines)


# What each contender is drawn as: kvtier's two paths solid, torch's dashed.
_LINES = {
    "kvtier_batched": ("kvtier, batched", "-", "o"),
    "kvtier_per_copy": ("kvtier, a copy per page", "-", "s"),
    "torch_gather": ("torch: gather + one copy", "--", "^"),
    "torch_per_block": ("torch: copy_ per block", "--", "v"),
}


_TITLES = {"h2d": "loads (host to GPU)", "d2h": "stores (GPU to host)", "both": "both at once"}


def plot(result: dict[str, Any], path: Any) -> None:
    """GB/s against page size, one panel per direction, each contender a
    line over every layout's pages (what decides the speed is the page),
    the contiguous pinned ceiling dashed across. Who calls: ``kvtier bench
    copy --device cuda`` beside its JSON. Blocks while it draws; raises
    ImportError without matplotlib."""
    from kvtier.bench.plots import pyplot, save_figure

    plt = pyplot()
    rows = [r for r in result["rows"] if r.get("measure") == "copy" and "gbps" in r]
    ways = ("h2d", "d2h", "both")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharex=True)
    for ax, way in zip(axes, ways):
        for who, (label, style, marker) in _LINES.items():
            pts = sorted(
                (r["page_bytes"], r["gbps"])
                for r in rows
                if r["direction"] == way and r["contender"] == who
            )
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, marker=marker, markersize=4, label=label)
        ceiling = [r["ceiling_gbps"] for r in rows if r["direction"] == way]
        if ceiling:
            ax.axhline(max(ceiling), color="grey", linestyle=":", label="contiguous pinned copy")
        ax.set_xscale("log", base=2)
        ax.set_title(_TITLES[way])
        ax.set_xlabel("page bytes (one layer's part of a block)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    gpu = result.get("gpu", {}).get("gpu", "GPU")
    fig.suptitle(f"KV copies between {gpu} and registered host memory")
    save_figure(fig, path)
