#!/usr/bin/env bash
# On the H200, from the repo root, after `source .device/carry/setup.sh` (one device call):
#   BEFORE=.before bash scripts/ab_step.sh SHAPE[:VARIANTS[:ROUNDS]] ...    e.g. 125m:coda-graphs:2 8b-slice:coda:1
# One change's effect on the step: scripts/bench.py with the coda_train/ under $BEFORE (made here by
# `mkdir -p .before && git archive HEAD coda_train | tar -x -C .before`, and carried) and with the working
# tree's, alternately (before, after, before, ...), each run its own process. Variants default to
# coda-graphs, rounds to 2. One line per run, as bench.py prints its variant rows, into $OUT/ab_step.txt.
set -uo pipefail
OUT=${OUT:-runs/ab_step}
BEFORE=${BEFORE:-.before}
mkdir -p "$OUT" /tmp/ab_step
[ -d "$BEFORE/coda_train" ] || { echo "no $BEFORE/coda_train: make it with git archive (see the header)"; exit 2; }
for spec in "$@"; do
  IFS=: read -r shape variants rounds <<< "$spec"
  variants=${variants:-coda-graphs}; rounds=${rounds:-2}
  for r in $(seq "$rounds"); do
    for side in before after; do
      path=$PWD; [ "$side" = before ] && path=$PWD/$BEFORE:$PWD
      PYTHONPATH=$path:$PYTHONPATH timeout "${BENCH_TIMEOUT:-300}" python3 scripts/bench.py --shape "$shape" \
        --variants "$variants" --profile-steps 0 --out "/tmp/ab_step/$side$r" > "/tmp/ab_step/$shape-$side$r.log" 2>&1 \
        || { echo "$shape $side$r failed:"; tail -n 20 "/tmp/ab_step/$shape-$side$r.log"; }
      for v in ${variants//,/ }; do
        grep -E "^$v +[0-9]" "/tmp/ab_step/$shape-$side$r.log" | head -n 1 | sed "s/^/$shape $side$r /"
      done | tee -a "$OUT/ab_step.txt"
    done
  done
done
