#!/usr/bin/env bash
# Does a tile table (a tune run's output, or entries written by hand) speed the step over the shipped one?
# One device call (any card), from the project root, after sourcing the site's setup.sh:
#
#   bash scripts/device_table_ab.sh TABLE SHAPE [SHAPE ...]     # TABLE: a tile_configs.json
#
# 1. B1 (gemm_dswiglu_rowscale_stat) at each SHAPE's width: scripts/epilogue_ablation.py's `bare` and `op`
#    rows, sustained, with the shipped table and with TABLE ($OUT/ablation_{shipped,table}.txt);
# 2. each SHAPE's coda-graphs step with the shipped table and with TABLE, in separate processes, the
#    order alternating by round (shipped first in odd rounds), until ROUNDS rounds or the call's TOTAL_S
#    ($OUT/step_ab.txt: label, time, then bench.py's coda-graphs row).
# ROUNDS (default 3), TOTAL_S (default 560), SUSTAINED (ablation seconds, default 2; 0 skips step 1).
set -uo pipefail
TABLE=$1; shift
TOTAL_S=${TOTAL_S:-560}
OUT=${OUT:-runs/table_ab}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u '+%Y-%m-%d %H:%M UTC'), $TABLE, $*"
if [ "${SUSTAINED:-2}" != 0 ]; then
  widths=$(for s in "$@"; do echo "$s" | sed 's/-.*//'; done | sort -u | paste -sd,)  # epilogue_ablation's 125m, 1b, 8b
  for label in shipped table; do
    env $([ $label = table ] && echo "CODA_TILE_CONFIGS=$TABLE" || echo UNUSED=1) timeout 150 python3 scripts/epilogue_ablation.py \
      --shapes "$widths" --rows "bare,op" --sustained "${SUSTAINED:-2}" --out "/tmp/table_ab_$label" 2>&1 \
      | grep -v -i warn | tail -n 4 | tee "$OUT/ablation_$label.txt"
  done
fi
step() {  # $1: label, $2: shape: one bench.py run of the shape's coda-graphs step, within what the call has left
  local label=$1 shape=$2 left=$(( TOTAL_S - SECONDS ))
  [ $left -gt 70 ] || return 1
  env $([ $label = table ] && echo "CODA_TILE_CONFIGS=$TABLE" || echo UNUSED=1) timeout $(( left > 150 ? 150 : left )) \
    python3 scripts/bench.py --shape "$shape" --variants coda-graphs --profile-steps 0 --out "/tmp/table_ab_$label" 2>&1 \
    | grep -E "^coda-graphs " | sed "s/^/$shape $label $(date -u +%H:%M:%S) /" | tee -a "$OUT/step_ab.txt"
}
for round in $(seq "${ROUNDS:-3}"); do
  order="shipped table"; [ $((round % 2)) = 0 ] && order="table shipped"
  for shape in "$@"; do for label in $order; do step $label "$shape" || break 3; done; done
done
echo "end $(date -u +%H:%M:%S)"
