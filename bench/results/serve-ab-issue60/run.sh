#!/bin/bash
# Issue 60's serving sweep: before (04ac9a3) and after (HEAD) interleaved, trace rate and 4x.
cd /work/main
for rep in 1 2 3; do
  for ts in 1 0.25; do
    for ver in after before; do
      if [ $ver = after ]; then PY=/work/main/.venv-engine/bin/python; CF=ideal,host,host+disk; else PY=/work/venv-before/bin/python; CF=host,host+disk; fi
      out=/work/sweep60/$ver-ts$ts-r$rep
      echo "$(date +%T) start $out"
      .venv/bin/kvtier bench serve --server --python $PY --configs $CF --workloads trace --time-scale $ts --repeats 1 --out $out > $out.log 2>&1
      echo "$(date +%T) rc=$? $out"
    done
  done
done
echo DONE
