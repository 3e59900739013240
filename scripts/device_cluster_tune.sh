#!/usr/bin/env bash
# Do 2x2 clusters (both GEMM operands multicast: half the L2 reads of a 2x1 or 1x2 cluster) speed the
# fused GEMMs whose epilogue traffic competes with the operands for the L2 (docs/kernels.md, "Where B1's
# traffic goes")? One device call (any card), from the project root, after sourcing the site's setup.sh:
#
#   bash scripts/device_cluster_tune.sh [SHAPE]          # SHAPE: a bench.py shape, default 125m
#
# 1. scripts/tune_gemm.py on SHAPE's epilogue GEMMs with 2x2 among the candidate clusters ($OUT/tune: the
#    table with this GPU's entries replaced, tune_gemm.md with every timing);
# 2. B1 at the tuned config: scripts/epilogue_ablation.py's bare / 4 tiles / op rows (the bare GEMM at the
#    same config: the floor's side of the comparison);
# 3. SHAPE's coda-graphs step / the graph floor in paired rounds with the tuned table ($OUT/bench_<shape>-tuned.json;
#    the floor's GEMMs get quack at 2x2 too wherever the tuned table runs it: bench.py floor_backends);
# 4. SHAPE's coda-graphs step with the shipped table and the tuned one, alternately, as many rounds as the
#    call's TOTAL_S leave ($OUT/step_ab.txt).
# TUNE_S bounds step 1 (default 200 s), TOTAL_S the whole call (default 590 s); PAIRED=0 skips step 3
# (then step 4 gets its time: the A/B of the tuned table alone).
set -uo pipefail
SHAPE=${1:-125m}
TOTAL_S=${TOTAL_S:-590}  # the call's seconds: steps 3 and 4 fit in what step 1 and 2 leave
OUT=${OUT:-runs/cluster_tune}
mkdir -p "$OUT/tune"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u '+%Y-%m-%d %H:%M UTC'), $SHAPE"
timeout $(( ${TUNE_S:-200} + 15 )) python3 scripts/tune_gemm.py --shapes "$SHAPE" --clusters 2x1,1x2,2x2 \
  --budget-s "${TUNE_S:-200}" --workers "$(( $(nproc) - 1 ))" --out "$OUT/tune" \
  --ops gemm_dswiglu_rowscale_stat,gemm_rmsnorm_backward,gemm_residual_rmsnorm_partial,gemm_rowscale_rope,gemm_rowscale_swiglu \
  2>&1 | grep -v -i warn | tail -n 8
tail -n 12 "$OUT/tune/tune_gemm.md" 2>/dev/null
[ -f "$OUT/tune/tile_configs.json" ] || { echo "no tuned table: stopping"; exit 1; }
tuned="CODA_TILE_CONFIGS=$OUT/tune/tile_configs.json"
ablation_shape=$(echo "$SHAPE" | sed 's/-.*//')  # epilogue_ablation.py's shapes: 125m, 1b, 8b
env "$tuned" timeout 90 python3 scripts/epilogue_ablation.py --shapes "$ablation_shape" --rows "bare,4 tiles,op" \
  --out "$OUT/ablation" 2>&1 | grep -v -i warn | tail -n 4
left=$(( TOTAL_S - SECONDS - 120 ))  # leaves one shipped/tuned round of step 4
[ "${PAIRED:-1}" != 0 ] && [ $left -gt 90 ] && env "$tuned" timeout $left python3 scripts/bench.py --shape "$SHAPE" --variants coda-graphs,floor \
  --profile-steps 0 --paired-rounds 3 --tag=-tuned --out "$OUT" 2>&1 | grep -v -i warn | tail -n 6
step() {  # $1: label, then env settings: one bench.py run of SHAPE's coda-graphs step, within what the call has left
  local label=$1 left=$(( TOTAL_S - SECONDS )); shift
  [ $left -gt 60 ] || return 1
  env "$@" timeout $(( left > 130 ? 130 : left )) python3 scripts/bench.py --shape "$SHAPE" --variants coda-graphs \
    --profile-steps 0 --out "/tmp/cluster_tune_$label" 2>&1 | grep -E "^coda-graphs " \
    | sed "s/^/$label $(date -u +%H:%M:%S) /" | tee -a "$OUT/step_ab.txt"
}
while step shipped UNUSED=1 && step tuned "$tuned"; do :; done
echo "end $(date -u +%H:%M:%S)"
