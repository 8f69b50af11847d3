"""Figures for the benchmarks' reports: matplotlib's pyplot without a
display, and a figure laid out, written and closed.

A command-line tool's module: runs in the process of whichever benchmark
draws. Who calls: the benchmarks' and soaks' report functions (``plot``,
``write_summary``). Blocks while it draws and writes the PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (benchmarks run headless).
    Raises ImportError where matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path | str, dpi: int = 110) -> None:
    """Lay ``fig`` out tightly, write it to ``path`` as PNG and free it (a
    long benchmark draws many figures; pyplot keeps each until closed)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
