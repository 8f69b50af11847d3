#!/bin/bash
# Issue 60's serving sweep: before (04ac9a3) and after (HEAD) interleaved, trace rate and 4x.
# Usage: run.sh ROUNDS OUTDIR. Odd rounds run after first, even rounds before first, so a
# drift of the machine over the sweep weighs on both alike. The first sweep (3 December,
# the JSONs beside this file) ran after first in every round.
cd /work/main
rounds=${1:-3}
outdir=${2:-/work/sweep60}
mkdir -p "$outdir"
for rep in $(seq 1 "$rounds"); do
  if [ $((rep % 2)) = 1 ]; then order="after before"; else order="before after"; fi
  for ts in 1 0.25; do
    for ver in $order; do
      if [ $ver = after ]; then PY=/work/main/.venv-engine/bin/python; CF=ideal,host,host+disk; else PY=/work/venv-before/bin/python; CF=host,host+disk; fi
      out=$outdir/$ver-ts$ts-r$rep
      echo "$(date +%T) start $out"
      .venv/bin/kvtier bench serve --server --python $PY --configs $CF --workloads trace --time-scale $ts --repeats 1 --out $out > $out.log 2>&1
      echo "$(date +%T) rc=$? $out"
    done
  done
done
echo DONE
