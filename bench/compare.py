"""Compare `make bench` runs of two builds: ``python bench/compare.py
--before DIR DIR... --after DIR DIR...`` (each DIR one ``bench/run.py --out``)
prints a Markdown table of every ratio the summary shows, per run and as
medians, after/before, the spread between runs of one build, and a verdict.

A change is "within noise" when |after/before - 1| is no larger than the
larger of the spreads seen between runs of the same build and 10%: these
machines are noisy, and only a difference larger than a build's own
run-to-run variation says something. A command-line tool; blocks on reading
the files only. Who calls: whoever reports a before/after (issue closing notes).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from kvtier.bench.report import latest, ratios


def _runs(dirs: list[str]) -> list[dict[str, tuple[float, str]]]:
    return [{what: (r, base) for what, r, base in ratios(latest(Path(d)))} for d in dirs]


def _spread(xs: list[float]) -> float:
    return (max(xs) / min(xs) - 1) if len(xs) > 1 and min(xs) > 0 else 0.0


def table(before: list[str], after: list[str]) -> str:
    """The Markdown table of ``before`` and ``after`` runs (directories)."""
    b, a = _runs(before), _runs(after)
    rows = [
        f"runs: before {len(b)}, after {len(a)}",
        "",
        "| benchmark | baseline | before (each run) | before median | after (each run) "
        "| after median | after/before | spread within before / within after | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for what in [w for w in b[0] if all(w in r for r in b + a)]:
        bs, as_ = [r[what][0] for r in b], [r[what][0] for r in a]
        bm, am = statistics.median(bs), statistics.median(as_)
        change = am / bm if bm else float("nan")
        noise = max(_spread(bs), _spread(as_), 0.10)
        verdict = "within noise" if abs(change - 1) <= noise else "OUTSIDE"
        rows.append(
            f"| {what} | {b[0][what][1]} | {', '.join(f'{x:.2f}' for x in bs)} | {bm:.2f} "
            f"| {', '.join(f'{x:.2f}' for x in as_)} | {am:.2f} | {change:.2f} "
            f"| +{_spread(bs):.0%} / +{_spread(as_):.0%} | {verdict} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", nargs="+", required=True)
    p.add_argument("--after", nargs="+", required=True)
    args = p.parse_args()
    print(table(args.before, args.after))


if __name__ == "__main__":
    main()
