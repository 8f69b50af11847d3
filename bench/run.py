"""Run the benchmarks a config lists (default: bench/configs/default.json).

A command-line tool (its own process; ``make bench`` runs it), blocking for
the whole run. Each entry is the argument list of one ``kvtier bench`` call;
results go with machine facts (the harness writes them) to ``--out DIR``,
default ``build/bench`` of this checkout (git ignores it), then one page of
all the ratios there: summary.md and summary.png. ``--out bench/results``
only for a run the summary in bench/results/README.md is to quote.
Relative ``--dir`` paths in a config are relative to the checkout, not to
the current directory, so running this from anywhere writes nowhere else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier.bench.report import write_summary
from kvtier.cli import main

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = REPO / "build" / "bench"


def _in_repo(args: list[str]) -> list[str]:
    """``--dir X`` with a relative X made relative to the checkout (created)."""
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a == "--dir":
            d = REPO / out[i + 1]
            d.mkdir(parents=True, exist_ok=True)
            out[i + 1] = str(d)
    return out


def run(config: Path, out: Path = DEFAULT_OUT) -> int:
    runs = json.loads(config.read_text())["runs"]
    failed = 0
    for args in runs:
        print(f"== kvtier bench {' '.join(args)}", flush=True)
        failed += main(["bench", *_in_repo(args), "--out", str(out)]) != 0
    md, png = write_summary(out)
    print(f"summary: {md}" + (f", {png}" if png else ""))
    return 1 if failed else 0


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run the benchmarks a config lists")
    ap.add_argument("config", nargs="?", type=Path, default=HERE / "configs" / "default.json")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return run(args.config, args.out)


if __name__ == "__main__":
    sys.exit(_main())
