"""Run the benchmarks a config lists (default: bench/configs/default.json).

Each entry is the argument list of one ``kvtier bench`` call; results go to
bench/results/ with machine facts (the harness writes them), then one page
of all the ratios: bench/results/summary.md and summary.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtier.bench.report import write_summary
from kvtier.cli import main

HERE = Path(__file__).resolve().parent


def run(config: Path) -> int:
    runs = json.loads(config.read_text())["runs"]
    Path("build/bench-disk").mkdir(parents=True, exist_ok=True)
    failed = 0
    for args in runs:
        print(f"== kvtier bench {' '.join(args)}", flush=True)
        failed += main(["bench", *args, "--results-dir", str(HERE / "results")]) != 0
    md, png = write_summary(HERE / "results")
    print(f"summary: {md}" + (f", {png}" if png else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "configs" / "default.json"))
