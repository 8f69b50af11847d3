"""Run the benchmarks a config lists (default: bench/configs/default.json).

Each entry is the argument list of one ``kvtier bench`` call; results go to
bench/results/ of this checkout with machine facts (the harness writes them),
then one page of all the ratios: bench/results/summary.md and summary.png.
Relative ``--dir`` paths in a config are relative to the checkout, not to
the current directory, so running this from anywhere writes nowhere else.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtier.bench.report import write_summary
from kvtier.cli import main

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _in_repo(args: list[str]) -> list[str]:
    """``--dir X`` with a relative X made relative to the checkout (created)."""
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a == "--dir":
            d = REPO / out[i + 1]
            d.mkdir(parents=True, exist_ok=True)
            out[i + 1] = str(d)
    return out


def run(config: Path) -> int:
    runs = json.loads(config.read_text())["runs"]
    failed = 0
    for args in runs:
        print(f"== kvtier bench {' '.join(args)}", flush=True)
        failed += main(["bench", *_in_repo(args), "--out", str(HERE / "results")]) != 0
    md, png = write_summary(HERE / "results")
    print(f"summary: {md}" + (f", {png}" if png else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "configs" / "default.json"))
