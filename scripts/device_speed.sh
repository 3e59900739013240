#!/usr/bin/env bash
# On the H200 host (1 or 2 GPUs), from the repo root, after `source .device/carry/setup.sh`; one device call:
#   bash scripts/device_speed.sh
# 1. the GPU tests (GPU 0) alongside scripts/tune_gemm.py (GPU 1, or after the tests on a 1-GPU host);
#    TESTS, TUNE_SHAPES, TUNE_OPS narrow them (TESTS=none skips the tests), TUNE_ARGS adds tune_gemm.py arguments
#    (e.g. "--sustained-s 1"), VARIANTS and PAIRS the benches;
# 2. bench.py at every shape with the tuned table ($CODA_TILE_CONFIGS = the tune run's output):
#    the strongest peers, coda, coda-graphs and the floor, shapes split over the GPUs (PAIRS= skips them);
# 3. with AB_SHAPES (space-separated), the shipped table against the tuned one on GPU 0: $AB_VARIANTS
#    (default coda-graphs) at each shape, alternately, two rounds each, into ab_tables.txt.
# Logs, the tuned table and the bench JSONs land in $OUT (the device tool returns at most 8 files:
# the benches' text tables are concatenated into one).
set -uo pipefail
OUT=${OUT:-runs/speed}
mkdir -p "$OUT" /tmp/speed
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
SECOND=$(( NGPU > 1 ? 1 : 0 ))
VARIANTS=${VARIANTS:-compile-graphs,liger,coda,coda-graphs,floor}

tests() { CUDA_VISIBLE_DEVICES=0 timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu ${TESTS:-tests} -p no:cacheprovider \
            -p no:warnings --tb=short 2>&1 | tail -n 60 > "$OUT/gpu_tests.log"; }
tune() { CUDA_VISIBLE_DEVICES=$SECOND timeout ${TUNE_TIMEOUT:-250} python3 scripts/tune_gemm.py --budget-s $(( ${TUNE_TIMEOUT:-250} - 15 )) \
           --shapes ${TUNE_SHAPES:-1b-4x4096,8b-slice,125m} ${TUNE_OPS:+--ops $TUNE_OPS} ${TUNE_ARGS:-} --out /tmp/speed/tune > /tmp/speed/tune.log 2>&1
         cp /tmp/speed/tune/tune_gemm.md /tmp/speed/tune/tile_configs.json "$OUT/" 2>/dev/null; tail -n 5 /tmp/speed/tune.log; }
bench() {  # GPU SHAPE
  CUDA_VISIBLE_DEVICES=$1 timeout ${BENCH_TIMEOUT:-150} python3 scripts/bench.py --shape "$2" --out "$OUT" --variants "$VARIANTS" \
    --profile-steps 1 2>&1 | grep -v -i warn | tail -n 40 > "/tmp/speed/bench_$2.txt"; }

[ "${TESTS:-}" = none ] && tests() { echo "GPU tests skipped (TESTS=none)" > "$OUT/gpu_tests.log"; }
if [ "$NGPU" -gt 1 ]; then tests & tune; wait; else tests; tune; fi
tail -n 3 "$OUT/gpu_tests.log"
[ -f /tmp/speed/tune/tile_configs.json ] && export CODA_TILE_CONFIGS=/tmp/speed/tune/tile_configs.json
for pair in ${PAIRS-1b-4x4096:125m 1b-2x8192:8b-slice}; do
  a=${pair%%:*}; b=${pair##*:}
  if [ "$a" = "$b" ]; then bench 0 "$a"  # PAIRS=SHAPE (no colon): that shape alone
  elif [ "$NGPU" -gt 1 ]; then bench 0 "$a" & bench 1 "$b"; wait; else bench 0 "$a"; bench 0 "$b"; fi
done
cat /tmp/speed/bench_*.txt > "$OUT/bench_tables.txt" 2>/dev/null; grep -E "^(variant|compile|liger|coda|floor|eager)" "$OUT/bench_tables.txt"
AB_VARIANTS=${AB_VARIANTS:-coda-graphs}
for shape in ${AB_SHAPES:-}; do
  for round in 1 2; do
    for table in shipped tuned; do
      ( [ "$table" = shipped ] && unset CODA_TILE_CONFIGS
        CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-150} python3 scripts/bench.py --shape "$shape" --variants "$AB_VARIANTS" \
          --profile-steps 0 --out "/tmp/speed/ab_$table$round" 2>&1 ) | grep -E "^($(echo "$AB_VARIANTS" | tr , '|')) " \
        | sed "s/^/$shape $table$round /" >> "$OUT/ab_tables.txt"
    done
  done
done
[ -n "${AB_SHAPES:-}" ] && cat "$OUT/ab_tables.txt"
